"""The shared background writer (jckpt.services.base): lease, lineage, two-stage commit, counters.

The mirror and the manager are its two subclasses; here a minimal subclass
writes each job to a file of its own (``gen_<info>.jckpt``), so what the base
class does is seen without either's rules.
"""

import errno
import logging
import os
import threading

import numpy as np
import pytest

import jckpt
from jckpt.errors import InputError, InUseError, LineageError
from jckpt.format.metadata import check_metadata
from jckpt.format.names import GENERATION_KEY, LINEAGE_KEY, NEXT_TAG
from jckpt.services.base import BackgroundWriter, Staged
from jckpt.services.engine import MirrorCounters
from jckpt.services.lineage import MANAGER_STEP
from jckpt.services.snapshot import namespace_leaves
from jckpt.storage.backend import backend_for
from jckpt.storage.lease import WriterLease, lease_path


class Files(BackgroundWriter[str]):
    """Job ``info`` goes to ``<directory>/gen_<info>.jckpt``; every job is written."""

    _holder = MANAGER_STEP
    _kind = 'test writer'

    def __init__(self, directory, *, latest=None, lineage=None, new_lineage=False, patience=3):
        self.directory = str(directory)
        self.latest = latest
        self.published: list[Staged[str]] = []
        self.lease_at_close: bool | None = None
        self.gate = threading.Event()  # cleared: staging waits (the disk is slow)
        self.gate.set()
        super().__init__(self.directory, backend=backend_for(self.directory), lease=self.directory,
                         ctx=None, lineage=lineage, new_lineage=new_lineage, slots=2,
                         when_full='block', retry_after=0.01,
                         patience=patience)

    def submit(self, info, tree, metadata=None):
        leaves = namespace_leaves({self.ctx.namespace: tree})
        return self._pipeline.admit(leaves, check_metadata(metadata, self.directory), info)

    def _recover(self):
        return None if self.latest is None else str(self.latest)

    def _target(self, info):
        if info == 'unwritable':
            raise OSError(errno.ENOSPC, 'No space left on device')
        self.gate.wait(30)
        return os.path.join(self.directory, f'gen_{info}.jckpt')

    def _on_published(self, staged):
        self.published.append(staged)

    def _on_close(self):
        self.lease_at_close = os.path.exists(lease_path(self.directory))


class Deduping(Files):
    """The same, skipping a job whose content equals the last generation's (as the mirror does)."""

    _dedupe = True


def ones(n=4, value=1.0):
    return {'w': np.full(n, value, np.float32)}


def metadata(path):
    return jckpt.describe(path).metadata_dict()


# --- check_metadata ----------------------------------------------------------------------------

def test_check_metadata_gives_a_dict_of_strings():
    assert check_metadata(None, 'f') == {}
    source = {'note': 'x', 'step': '3'}
    out = check_metadata(source, 'f')
    assert out == source and out is not source


@pytest.mark.parametrize('bad', [{'n': 3}, {3: 'x'}, {'n': None}, {'n': b'x'}])
def test_check_metadata_refuses_what_is_not_a_string(bad):
    with pytest.raises(InputError, match='metadata maps strings to strings') as info:
        check_metadata(bad, 'run.jckpt')
    assert info.value.file == 'run.jckpt' and ('str(value)' in info.value.fix or
                                               'use the key' in info.value.fix)


@pytest.mark.parametrize('key', [LINEAGE_KEY, GENERATION_KEY, 'jckpt.mine'])
def test_check_metadata_refuses_the_reserved_keys(key):
    with pytest.raises(InputError, match=f"metadata key '{key}' is reserved") as info:
        check_metadata({'ok': 'y', key: 'x'}, 'run.jckpt')
    assert info.value.file == 'run.jckpt' and "'jckpt.'" in info.value.fix
    assert check_metadata({'jckpt': 'x', 'my.jckpt.key': 'y'}, 'f')  # only the prefix is reserved


# --- the lease ---------------------------------------------------------------------------------

def test_the_lease_is_held_while_open_and_released_on_close(tmp_path):
    w = Files(tmp_path)
    lock = lease_path(str(tmp_path))
    assert os.path.exists(lock)
    with pytest.raises(InUseError, match='in use'):
        WriterLease(str(tmp_path))
    with pytest.raises(InUseError):
        Files(tmp_path)
    w.close()
    assert not os.path.exists(lock) and w.lease_at_close is False  # released before _on_close
    w.close()  # idempotent
    WriterLease(str(tmp_path)).release()
    Files(tmp_path).close()


def test_a_refused_open_releases_the_lease(tmp_path):
    plain = tmp_path / 'plain.jckpt'
    jckpt.save(jckpt.Context(), ones(), plain)  # no lineage: not this writer's
    with pytest.raises(LineageError, match='the latest step was not written by a checkpoint manager'):
        Files(tmp_path, latest=plain)
    assert not os.path.exists(lease_path(str(tmp_path)))
    Files(tmp_path).close()


def test_a_failing_recovery_releases_the_lease(tmp_path):
    class Broken(Files):
        def _recover(self):
            raise KeyboardInterrupt  # not even an Exception

    with pytest.raises(KeyboardInterrupt):
        Broken(tmp_path)
    assert not os.path.exists(lease_path(str(tmp_path)))


def test_a_bad_lineage_name_is_refused_before_the_lease(tmp_path):
    with pytest.raises(InputError, match='lineage must be a non-empty string'):
        Files(tmp_path, lineage='')
    assert not os.path.exists(lease_path(str(tmp_path)))


# --- staging, publishing, counters -------------------------------------------------------------

def test_each_job_is_published_in_order_with_lineage_and_generation(tmp_path):
    with Files(tmp_path, lineage='exp') as w:
        assert isinstance(w.counters, MirrorCounters) and w.counters.generation == 0
        assert [w.submit(str(i), ones(value=i), {'step': str(i)}) for i in (1, 2, 3)] == [1, 2, 3]
        assert w.wait_durable(timeout=60) is True
        c = w.counters
        assert (c.committed, c.durable, c.generation, c.pending, c.error) == (3, 3, 3, 0, 0)
        assert [(s.generation, os.path.basename(s.target)) for s in w.published] == [
            (1, 'gen_1.jckpt'), (2, 'gen_2.jckpt'), (3, 'gen_3.jckpt')]
        assert all(s.temporary is not None and s.digest is not None for s in w.published)
    for i in (1, 2, 3):
        md = metadata(tmp_path / f'gen_{i}.jckpt')
        assert md == {'step': str(i), LINEAGE_KEY: 'exp', GENERATION_KEY: str(i)}
        out = jckpt.restore(jckpt.Context(), ones(), tmp_path / f'gen_{i}.jckpt', verify=True)
        np.testing.assert_array_equal(out['w'], np.full(4, i, np.float32))
    assert not [n for n in os.listdir(tmp_path) if NEXT_TAG in n]  # no staged file left


def test_without_dedupe_equal_content_is_written_again(tmp_path):
    with Files(tmp_path) as w:
        w.submit('a', ones())
        w.submit('b', ones())
        w.wait_durable()
        assert w.counters.generation == 2 and len(w.published) == 2
    assert os.path.exists(tmp_path / 'gen_b.jckpt')


def test_with_dedupe_equal_content_makes_no_generation(tmp_path):
    with Deduping(tmp_path) as w:
        w.submit('a', ones())
        w.submit('b', ones())                            # equal: nothing written
        w.submit('c', ones(), {'note': 'x'})             # user metadata differs: written
        w.wait_durable()
        c = w.counters
        assert (c.committed, c.durable, c.generation) == (3, 3, 2)
        assert [os.path.basename(s.target) for s in w.published] == ['gen_a.jckpt', 'gen_c.jckpt']
    assert not os.path.exists(tmp_path / 'gen_b.jckpt')


def test_the_lineage_found_is_continued_with_its_content(tmp_path):
    with Deduping(tmp_path, lineage='exp') as w:
        w.submit('1', ones())
        w.submit('2', ones(value=2.0))
    latest = tmp_path / 'gen_2.jckpt'
    with Deduping(tmp_path, latest=latest) as w:
        assert w.lineage == 'exp' and w.counters.generation == 2
        w.submit('3', ones(value=2.0))       # equal to the checkpoint found: skipped
        w.wait_durable()
        assert w.counters.generation == 2 and not w.published
        w.submit('4', ones(value=4.0))
    assert metadata(tmp_path / 'gen_4.jckpt')[GENERATION_KEY] == '3'
    with Deduping(tmp_path, latest=latest, new_lineage=True) as w:
        assert w.lineage != 'exp' and w.counters.generation == 0
        w.submit('5', ones(value=2.0))       # a new lineage knows no content: written
    assert metadata(tmp_path / 'gen_5.jckpt')[GENERATION_KEY] == '1'
    with pytest.raises(LineageError, match="belongs to lineage 'exp'"):
        Files(tmp_path, latest=latest, lineage='other')


def test_wait_durable_gives_false_when_the_timeout_passes_first(tmp_path):
    with Files(tmp_path) as w:
        w.gate.clear()
        w.submit('slow', ones())
        assert w.wait_durable(timeout=0.05) is False
        assert w.counters.durable == 0 and w.counters.pending == 1
        w.gate.set()
        assert w.wait_durable(timeout=60) is True
        assert w.counters.durable == 1


def test_wait_durable_raises_the_error_after_patience(tmp_path):
    w = Files(tmp_path, patience=2)
    try:
        w.submit('unwritable', ones())
        with pytest.raises(OSError, match='No space left'):
            w.wait_durable(timeout=60)
        assert w.counters.error == 'ENOSPC' and w.counters.failures >= 2
    finally:
        with pytest.raises(OSError):
            w.close()
    assert not os.path.exists(lease_path(str(tmp_path)))  # released even so
    with Files(tmp_path) as again:
        assert again.wait_durable(timeout=0) is True  # nothing submitted: durable at once


# --- the context manager -----------------------------------------------------------------------

def test_the_context_manager_returns_the_writer_and_closes_it(tmp_path):
    with Files(tmp_path) as w:
        assert isinstance(w, Files)
        w.submit('x', ones())
    assert w.lease_at_close is False and os.path.exists(tmp_path / 'gen_x.jckpt')
    with pytest.raises(jckpt.CheckpointError, match='closed'):
        w.submit('y', ones())


def test_an_error_in_the_block_is_kept_and_the_work_made_durable(tmp_path):
    with pytest.raises(KeyError, match='from the block'):
        with Files(tmp_path) as w:
            w.submit('x', ones())
            raise KeyError('from the block')
    assert os.path.exists(tmp_path / 'gen_x.jckpt')
    assert not os.path.exists(lease_path(str(tmp_path)))


def test_a_close_error_after_an_error_in_the_block_is_logged_not_raised(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger='jckpt'):
        with pytest.raises(KeyError, match='from the block'):
            with Files(tmp_path, patience=1) as w:
                w.submit('unwritable', ones())
                raise KeyError('from the block')
    assert any('closing the test writer of' in r.getMessage() and 'No space left' in r.getMessage()
               for r in caplog.records if r.levelno == logging.ERROR)
    assert w.lease_at_close is False


def test_a_close_error_without_an_error_in_the_block_is_raised(tmp_path):
    with pytest.raises(OSError, match='No space left'):
        with Files(tmp_path, patience=1) as w:
            w.submit('unwritable', ones())
    assert not os.path.exists(lease_path(str(tmp_path)))


def test_the_pipelines_stages_are_not_on_the_writers_surface(tmp_path):
    """`stage`, `publish`, `discard` and `rollback` showed in a Mirror's and a manager's
    completion, undocumented: they are the pipeline's, through an adapter."""
    import jckpt
    with jckpt.Mirror(tmp_path / 'm.jckpt') as mirror, jckpt.CheckpointManager(tmp_path / 'run') as mgr:
        for writer in (mirror, mgr):
            assert not {'stage', 'publish', 'discard', 'rollback'} & set(dir(writer))
