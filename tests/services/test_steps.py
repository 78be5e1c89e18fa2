"""What is on disk in a manager's directory: reading any kind of step, clearing staging."""

import json
import os

import numpy as np
import pytest

import jckpt
from jckpt.errors import FormatError, InputError
from jckpt.format.names import METRICS_KEY, STEP_KEY, TRAINER_STATE_KEY, step_name
from jckpt.services import steps
from jckpt.services.formats import CheckpointLoadOptions, CheckpointOptions
from jckpt.storage.backend import backend_for


def test_read_metadata_and_tree_of_a_file_and_of_a_step_directory(tmp_path):
    with jckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {'w': np.arange(3.0)}, metrics={'loss': 2.0})
        mgr.save(2, items={'model': {'w': np.arange(3.0) + 1}, 'opt': {'m': np.ones(2)}},
                 metrics={'loss': 1.0}, trainer_state=jckpt.TrainerState(global_step=2),
                 options=CheckpointOptions(format='safetensors'))
    ctx = jckpt.Context()
    for step, path in ((1, tmp_path / 'step_00000001.jckpt'), (2, tmp_path / 'step_00000002.jckpt')):
        meta = steps.read_metadata(str(path), step)
        assert meta[STEP_KEY] == str(step)
        assert steps.parse_metrics(meta[METRICS_KEY], str(path)) == {'loss': 3.0 - step}
    assert json.loads(meta[TRAINER_STATE_KEY])['global_step'] == 2
    both = steps.read_tree(ctx, str(path), 2, None, None, False, CheckpointLoadOptions())
    assert sorted(both) == ['model', 'opt']
    only = steps.read_tree(ctx, str(path), 2, None, ['opt'], False, CheckpointLoadOptions())
    assert list(only) == ['opt']
    first = steps.read_tree(ctx, str(tmp_path / 'step_00000001.jckpt'), 1, {'w': np.zeros(3)}, None,
                            False, CheckpointLoadOptions())
    np.testing.assert_array_equal(first['w'], np.arange(3.0))


def test_parse_metrics_tolerates_damage():
    assert steps.parse_metrics(None, 'x') == {} and steps.parse_metrics('[1', 'x') == {}
    assert steps.parse_metrics('{"a": 1}', 'x') == {'a': 1.0}


def test_checked_options():
    default = CheckpointOptions(format='npz')
    assert steps.checked(None, CheckpointOptions, 'options', default) is default
    assert steps.checked(None, CheckpointOptions, 'options') == CheckpointOptions()
    with pytest.raises(InputError, match="options must be a CheckpointOptions, not dict"):
        steps.checked({}, CheckpointOptions, 'options')


@pytest.mark.parametrize('directory_step', [False, True])
def test_a_step_that_links_out_of_the_managers_directory_is_refused(tmp_path, caplog, directory_step):
    """A link planted in a manager's directory made it read, list and resume from any
    checkpoint the process could reach; it is now refused, and listed as unreadable."""
    archive = tmp_path / 'elsewhere'
    if directory_step:
        with jckpt.CheckpointManager(archive, options=CheckpointOptions(format='npz')) as mgr:
            mgr.save(7, {'w': np.full(2, 7.0)})
    else:
        with jckpt.CheckpointManager(archive) as mgr:
            mgr.save(7, {'w': np.full(2, 7.0)})
    run = tmp_path / 'run'
    with jckpt.CheckpointManager(run) as mgr:
        mgr.save(1, {'w': np.ones(2)})
    link = run / 'step_00000007.jckpt'
    os.symlink(archive / 'step_00000007.jckpt', link)
    with jckpt.CheckpointManager(run) as mgr:
        assert mgr.all_steps() == [1] and mgr.latest_step() == 1
        assert 'outside the manager' in caplog.text
        with pytest.raises(FormatError, match="outside the manager's directory") as info:
            mgr.restore(7)
        assert str(link) in str(info.value) and 'cp -rL' in info.value.fix
        assert mgr.restore().step == 1
    step = next(s for s in jckpt.info(str(run)).steps if s.step == 7)
    assert 'outside the manager' in step.error
    assert sorted(os.listdir(archive)) and os.path.islink(link)  # nothing deleted either side
def test_opening_a_bucket_manager_reads_each_file_step_once(monkeypatch):
    """3,000 steps took 9,013 requests (45 s): a HEAD for a step record, a LIST of the step as
    a prefix, then the GET of its header; now the listing tells file steps apart."""
    from jckpt.storage import object_store
    from jckpt.storage.object_backend import OBJECT_STORE
    url = "memory://open-requests/run"
    with jckpt.CheckpointManager(url) as mgr:
        for step in range(1, 6):
            mgr.save(step, {"w": np.ones(2)})
    calls = []
    for name in ("exists", "isdir", "list", "list_kinds", "list_versions"):
        real = getattr(OBJECT_STORE, name)
        monkeypatch.setattr(OBJECT_STORE, name,
                            lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
    real_head = object_store.ObjectSource.head
    monkeypatch.setattr(object_store.ObjectSource, "head",
                        lambda self, n: (calls.append("GET"), real_head(self, n))[1])
    with jckpt.CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [1, 2, 3, 4, 5]
    # a GET per step (the lineage check takes the latest's from the scan); one listing
    assert calls.count("GET") == 5 and "isdir" not in calls, calls
    assert sum(c in ("exists", "list", "list_kinds", "list_versions") for c in calls) == 1, calls


def test_a_step_named_prefix_of_somebody_elses_objects_is_left(caplog):
    """The bucket's branch still deleted a step-named prefix of the user's own objects."""
    import logging
    url = "memory://own-objects/run"
    with jckpt.CheckpointManager(url) as mgr:
        mgr.save(1, {"w": np.ones(2)})
    backend = backend_for(url)
    with backend.create(f"{url}/step_00000099.jckpt/notes.txt") as staging_file:
        os.write(staging_file.fd, b"mine")
        staging_file.publish()
    with caplog.at_level(logging.WARNING):
        with jckpt.CheckpointManager(url) as mgr:
            assert mgr.all_steps() == [1]
    assert backend.list(f"{url}/step_00000099.jckpt") == ["notes.txt"]
    assert "files no manager writes (notes.txt)" in caplog.text


def test_opening_a_bucket_manager_of_format_steps_asks_no_header_of_them(monkeypatch):
    """Trying each step as a file first cost a failed GET (and a LIST) per step directory."""
    from jckpt.storage import object_store
    url = "memory://open-format/run"
    with jckpt.CheckpointManager(url, options=CheckpointOptions(format='npz')) as mgr:
        for step in range(1, 5):
            mgr.save(step, items={'model': {'w': np.ones(2)}, 'opt': {'m': np.ones(2)}})
    heads = []
    real_head = object_store.ObjectSource.head
    monkeypatch.setattr(object_store.ObjectSource, "head",
                        lambda self, n: (heads.append(self.u.key), real_head(self, n))[1])
    with jckpt.CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [1, 2, 3, 4]
    assert not [k for k in heads if k.rsplit('/', 1)[-1].startswith('step_')], heads


def test_a_directory_step_removed_since_it_was_listed_is_an_error_naming_it():
    pytest.importorskip("obstore")
    url = "memory://steps-indexed/run"
    with jckpt.CheckpointManager(url, directory_steps=True) as mgr:
        mgr.save(1, {'w': np.ones(2)})
    path = f"{url}/step_00000001.jckpt"
    backend_for(url).remove(path)
    with pytest.raises(FormatError, match="no step 1: it was removed since") as e:
        with steps.step_metadata(path, 1, True, indexed=True):
            pass
    assert e.value.file == path


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_step_is_gone_once_what_it_is_listed_by_is(where, tmp_path):
    """A listed step whose read failed is no step once its file, or its prefix's marker, is
    gone: what is left of a prefix whose markers a removal deleted first is no step."""
    pytest.importorskip("obstore")
    root = str(tmp_path) if where == "local" else "memory://steps-gone/run"
    with jckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {'w': np.ones(2)})
        mgr.save(2, {'w': np.ones(2)}, options=CheckpointOptions(format='npz'))
    one, two = f"{root}/step_00000001.jckpt", f"{root}/step_00000002.jckpt"
    assert not steps.gone(one, False) and not steps.gone(two, True)
    backend = backend_for(root)
    backend.remove(one, below=False) if where == "memory" else os.remove(one)
    assert steps.gone(one, False) and not steps.gone(two, True)
    if where == "memory":
        backend.remove(f"{two}/trainer_state.json", below=False)  # the model file stays
        assert steps.gone(two, True) and backend.exists(f"{two}/model.npz")


def test_a_listed_step_not_known_to_be_gone_is_not_gone(monkeypatch, caplog):
    """Asked once a read of a listed step failed, `gone` asks the storage once more; where that
    request failed too, its error replaced the read's: the scan of the whole directory, and a
    restore's, stopped there. Now the step is not called gone, and the read's error counts."""
    pytest.importorskip("obstore")
    from jckpt.errors import StorageError
    url = "memory://steps-untold/run"
    with jckpt.CheckpointManager(url) as mgr:
        for step in (1, 2):
            mgr.save(step, {'w': np.ones(2)})
    one = f"{url}/{step_name(1)}"
    real_read = steps._read_step

    def damaged(path, step, prefix, *kept):
        if path == one:
            raise FormatError("damaged", file=path)
        return real_read(path, step, prefix, *kept)

    def failing(self, path):
        raise StorageError("connection reset", file=path)
    monkeypatch.setattr(steps, "_read_step", damaged)
    monkeypatch.setattr(type(backend_for(url)), "exists", failing)
    assert not steps.gone(one, False)
    with caplog.at_level("WARNING", logger="jckpt"):
        found = steps.scan(backend_for(url), url)
    assert sorted(found.metrics) == [2] and found.vanished == ()
    assert f"ignoring unreadable step {step_name(1)}: {one}: damaged" in caplog.text


@pytest.mark.parametrize('read_only', [False, True])
def test_opening_a_manager_reads_step_headers_without_the_general_reader(tmp_path, monkeypatch,
                                                                          caplog, read_only):
    """A manager opening 1,000 steps spent two thirds of its time in the general header
    reader's scan for crafted repetitions and parse, once per step: the steps a manager
    writes are read without them, and a damaged one is still left out, named."""
    import logging

    from jckpt.format import prescan
    with jckpt.CheckpointManager(tmp_path, asynchronous=False) as mgr:
        for step in range(1, 6):
            mgr.save(step, {'w': np.arange(3.0)}, metrics={'loss': 1 / step},
                     trainer_state=jckpt.TrainerState(global_step=step))
    damaged = tmp_path / step_name(3)
    raw = bytearray(damaged.read_bytes())
    raw[raw.index(b'(jckpt.step 3)') + 12] = ord('8')
    damaged.write_bytes(bytes(raw))
    general = []
    monkeypatch.setattr(prescan, 'check_header', lambda text: general.append(text))
    with caplog.at_level(logging.WARNING, logger='jckpt'):
        with jckpt.CheckpointManager(tmp_path, read_only=read_only) as mgr:
            assert mgr.all_steps() == [1, 2, 4, 5] and mgr.best_step('loss') == 5
            assert mgr.metrics(4) == {'loss': 0.25}
    assert general == []
    assert f"ignoring unreadable step {step_name(3)}" in caplog.text
    assert "header checksum mismatch" in caplog.text
