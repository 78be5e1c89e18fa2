"""``jckpt.storage.staging``: generations written under a temporary name, published in order later."""

import errno
import os

import numpy as np
import pytest

from jckpt.errors import StorageError
from jckpt.format.entries import entry_for
from jckpt.format.names import NEXT_TAG, STAGE_TAG, STEP_RE
from jckpt.storage.publish import StagingFile
from jckpt.storage.reader import CheckpointReader
from jckpt.storage.staging import (
    discard_staged,
    finish_staged,
    next_name,
    remove_staged,
    stage_items,
    write_items,
)
from jckpt.storage.writer import ArraySource
from jckpt.version import __version__


def item(value):
    array = np.full(3, value, np.float32)
    return [entry_for('jckpt', (('k', 'w'),), array.dtype, array.shape, id=0)], [ArraySource(array)]


def stage(temporary, target, value):
    entries, sources = item(value)
    stage_items(temporary, target, entries, sources, metadata={'gen': str(value)}, alignment=32)


def value_at(path):
    r = CheckpointReader(path)
    return float(r.decode(r.header.tensors[0])[0]), dict(r.header.metadata)


def abandoned_stage(path):
    """A staging file of ``path`` whose writer is gone (its name as a writer makes it, unlocked)."""
    name = f"{path}{STAGE_TAG}0000abcd.00000001.0123456789abcdef"
    open(name, 'wb').close()
    return os.path.basename(name)


def test_next_name():
    assert next_name('/d/run.jckpt', 1) == '/d/run.jckpt' + NEXT_TAG + '1'
    assert next_name('run.jckpt', 12) == 'run.jckpt.jckpt-next.12'
    assert STEP_RE.match(next_name('step_00000001.jckpt', 3)) is None  # never taken for a step


def test_write_items_publishes_a_laid_out_file(tmp_path):
    target = str(tmp_path / 'm.jckpt')
    entries, sources = item(2.0)
    header = write_items(target, entries, sources, metadata={'a': 'b'}, alignment=64,
                         durable=True)
    assert header.writer == f"jckpt {__version__}" and header.alignment == 64
    assert header.tensors[0].checksum is not None
    assert value_at(target) == (2.0, {'a': 'b'})
    assert os.listdir(tmp_path) == ['m.jckpt']


@pytest.mark.parametrize('durable', [True, False])
def test_a_staged_generation_replaces_the_target_only_when_finished(tmp_path, durable):
    target = str(tmp_path / 'run.jckpt')
    stage(next_name(target, 1), target, 1.0)
    finish_staged(next_name(target, 1), target, durable=durable)
    stage(next_name(target, 2), target, 2.0)
    stage(next_name(target, 3), target, 3.0)  # the next one is written while 2 waits
    assert value_at(target) == (1.0, {'gen': '1.0'})  # readers still see generation 1
    assert sorted(os.listdir(tmp_path)) == ['run.jckpt', 'run.jckpt.jckpt-next.2',
                                            'run.jckpt.jckpt-next.3']
    finish_staged(next_name(target, 2), target, durable=durable)
    assert value_at(target) == (2.0, {'gen': '2.0'})
    finish_staged(next_name(target, 3), target, durable=durable)
    assert value_at(target) == (3.0, {'gen': '3.0'})
    assert os.listdir(tmp_path) == ['run.jckpt']


def test_a_failed_stage_names_the_target_and_leaves_nothing(tmp_path):
    target = str(tmp_path / 'run.jckpt')
    entries, _ = item(1.0)
    wrong = [ArraySource(np.zeros(2, np.float32))]  # 8 bytes for an entry of 12
    with pytest.raises(StorageError, match='wrote 8 bytes for an entry of 12') as info:
        stage_items(next_name(target, 1), target, entries, wrong, metadata={}, alignment=32)
    assert info.value.file == target and info.value.entry == 'jckpt/w'
    assert os.listdir(tmp_path) == []


def test_finishing_a_missing_generation_is_a_storage_error(tmp_path):
    target = str(tmp_path / 'run.jckpt')
    for durable in (True, False):
        with pytest.raises(StorageError, match='publishing the checkpoint failed') as info:
            finish_staged(next_name(target, 7), target, durable=durable)
        assert info.value.file == target and info.value.errno == errno.ENOENT


def test_discard_staged(tmp_path):
    target = str(tmp_path / 'run.jckpt')
    stage(next_name(target, 1), target, 1.0)
    discard_staged(next_name(target, 1))
    assert os.listdir(tmp_path) == []
    discard_staged(next_name(target, 1))  # already gone: fine


def test_remove_staged_clears_what_a_dead_writer_left(tmp_path):
    target = str(tmp_path / 'run.jckpt')
    stage(next_name(target, 1), target, 1.0)
    finish_staged(next_name(target, 1), target, durable=False)
    stage(next_name(target, 2), target, 2.0)
    stage(next_name(target, 10), target, 10.0)
    half = abandoned_stage(next_name(target, 11))  # generation 11 died while being written
    own = abandoned_stage(target)  # another kind of staging file of the target itself
    others = ['other.jckpt.jckpt-next.1', 'run.jckpt2.jckpt-next.1', 'run.jckpt.jckpt-next.x']
    for name in others:
        open(tmp_path / name, 'wb').close()
    removed = remove_staged(target)
    assert sorted(removed) == sorted(['run.jckpt.jckpt-next.2', 'run.jckpt.jckpt-next.10', half])
    assert sorted(os.listdir(tmp_path)) == sorted(['run.jckpt', own, *others])
    assert value_at(target)[0] == 1.0
    assert remove_staged(target) == []


def test_remove_staged_keeps_a_generation_being_written(tmp_path):
    target = str(tmp_path / 'run.jckpt')
    with StagingFile(next_name(target, 4)) as live:  # a live writer holds its lock
        assert remove_staged(target) == []
        assert os.path.exists(live.path)


def test_remove_staged_in_a_missing_directory_removes_nothing(tmp_path):
    assert remove_staged(str(tmp_path / 'missing' / 'run.jckpt')) == []


def test_a_killed_mirrors_generations_go_with_the_next_save_of_its_path(tmp_path):
    """A mirror killed mid-write left `.jckpt-next.N` files that only another mirror of
    the path removed: a plain save over it left megabytes behind."""
    import jckpt
    from jckpt.storage.lease import WriterLease, lease_path
    target = tmp_path / 'm.jckpt'
    stale = [tmp_path / 'm.jckpt.jckpt-next.3',
             tmp_path / 'm.jckpt.jckpt-next.4.jckpt-stage.00004cfc.00000001.ffead962fc1483ed']
    for f in stale:
        f.write_bytes(b'x' * 100)
    jckpt.save(jckpt.Context(), {'w': np.ones(2)}, target)  # no lease file: no mirror here
    assert all(f.exists() for f in stale)
    with WriterLease(target):  # a live mirror's generations stay
        jckpt.save(jckpt.Context(), {'w': np.ones(2)}, target)
        assert all(f.exists() for f in stale)
    open(lease_path(target), 'w').close()  # what a killed mirror leaves: a lease no one holds
    jckpt.save(jckpt.Context(), {'w': np.ones(2)}, target)
    assert not any(f.exists() for f in stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['m.jckpt']  # its lease file too
