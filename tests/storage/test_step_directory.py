"""Step directories: staged, published whole by one rename, removed when abandoned."""

import os

import pytest

from jckpt.errors import StorageError
from jckpt.storage import step_directory as sd


def test_a_staged_directory_is_published_whole(tmp_path):
    staged, target = str(tmp_path / 'step.next.1'), str(tmp_path / 'step')
    sd.make_staged(staged)
    sd.write_text(os.path.join(staged, 'a.txt'), 'é\n')
    assert not sd.is_published(staged, 'marker.json')
    sd.write_text(os.path.join(staged, 'marker.json'), '{}')
    for durable in (True,):
        sd.publish_dir(staged, target, durable=durable)
    assert sorted(os.listdir(tmp_path)) == ['step']
    assert sd.is_published(target, 'marker.json') and sd.is_file(os.path.join(target, 'a.txt'))
    assert sd.read_text(os.path.join(target, 'a.txt')) == 'é\n'
    assert not sd.is_published(os.path.join(target, 'a.txt'), 'marker.json')


def test_make_staged_clears_an_earlier_attempt_and_remove_is_idempotent(tmp_path):
    staged = str(tmp_path / 'step.next.2')
    sd.make_staged(staged)
    sd.write_text(os.path.join(staged, 'old'), 'x')
    sd.make_staged(staged)
    assert os.listdir(staged) == []
    sd.remove_staged_dir(staged)
    sd.remove_staged_dir(staged)
    (tmp_path / 'file.next.3').write_bytes(b'')
    sd.remove_staged_dir(str(tmp_path / 'file.next.3'))
    assert os.listdir(tmp_path) == []


def test_failures_are_storage_errors_naming_the_path(tmp_path):
    with pytest.raises(StorageError) as e:
        sd.read_text(str(tmp_path / 'missing'))
    assert e.value.file == str(tmp_path / 'missing')
    with pytest.raises(StorageError):
        sd.write_text(str(tmp_path / 'no' / 'dir'), 'x')
    with pytest.raises(StorageError):
        sd.publish_dir(str(tmp_path / 'absent'), str(tmp_path / 'step'), durable=False)


@pytest.mark.parametrize('swaps', [True, False])
def test_publishing_over_a_step_directory_replaces_it(tmp_path, monkeypatch, swaps):
    """A retry whose first rename went through (the fsync after it failed) renamed its new
    staging directory onto the step, non-empty: ENOTEMPTY on every attempt, for good."""
    target = str(tmp_path / 'step_00000001.jckpt')
    for version in ('old', 'new'):
        staged = f"{target}.jckpt-next.{2 if version == 'new' else 1}"
        sd.make_staged(staged)
        sd.write_text(os.path.join(staged, 'v.txt'), version)
        if version == 'new' and not swaps:  # a filesystem without renameat2's exchange
            monkeypatch.setattr(sd, 'exchange', lambda a, b: False)
        sd.publish_dir(staged, target, durable=True)
    assert os.listdir(tmp_path) == ['step_00000001.jckpt']
    assert sd.read_text(os.path.join(target, 'v.txt')) == 'new'


def test_a_manager_recovers_from_a_failed_fsync_after_the_steps_rename(tmp_path, monkeypatch):
    import errno

    import numpy as np

    import jckpt
    real, failed = sd.fsync_dir, []

    def once(path):
        if os.path.abspath(path) == str(tmp_path) and not failed:
            failed.append(path)  # the step is in place; its durability is not known
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(path)

    monkeypatch.setattr(sd, 'fsync_dir', once)
    options = jckpt.CheckpointOptions(format='safetensors')
    with jckpt.CheckpointManager(tmp_path, options=options, retry_after=0.01) as mgr:
        mgr.save(1, {'w': np.ones(4, np.float32)})
        mgr.save(2, {'w': np.full(4, 2, np.float32)}, force=True)
        assert mgr.wait_durable(timeout=30)
        assert failed and mgr.counters.durable == 2 and mgr.all_steps() == [1, 2]
        assert mgr.restore(1).tree['jckpt']['w'].tolist() == [1, 1, 1, 1]
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith('.')) == [
        'step_00000001.jckpt', 'step_00000002.jckpt']


def _record(tmp_path, raw: bytes) -> str:
    step = tmp_path / 'step_00000001.jckpt'
    step.mkdir(exist_ok=True)
    (step / 'trainer_state.json').write_bytes(raw)
    return str(step)


@pytest.mark.parametrize('model', ['..', '.', '', 'trainer_state.json', 'optimizer.jckpt'])
def test_a_record_naming_no_model_file_of_its_own_is_refused(tmp_path, model):
    """'..' passed as a file name (verify then failed on an AssertionError), and the
    optimizer's file was restored as the model."""
    import json

    from jckpt.errors import FormatError
    step = _record(tmp_path, json.dumps({'model': model, 'model_namespace': 'jckpt',
                                         'metadata': {}}).encode())
    with pytest.raises(FormatError, match='not a step record'):
        sd.read_record(step, 1)


def test_a_record_that_is_a_fifo_or_not_utf8_is_refused_at_once(tmp_path):
    """A FIFO there blocked `jckpt verify` for ever; bytes that are not UTF-8 raised a bare
    UnicodeDecodeError from the manager, info and verify."""
    from jckpt.errors import FormatError
    step = _record(tmp_path, b'\xff{}')
    with pytest.raises(FormatError, match='not UTF-8'):
        sd.read_record(step, 1)
    fifo = os.path.join(step, 'trainer_state.json')
    os.unlink(fifo)
    os.mkfifo(fifo)
    with pytest.raises(FormatError, match='FIFO'):
        sd.read_record(step, 1)


def test_an_oversized_record_is_refused_reading_no_more_than_the_limit(tmp_path, monkeypatch):
    from jckpt.errors import FormatError
    monkeypatch.setattr(sd, 'MAX_RECORD_BYTES', 100)
    step = _record(tmp_path, b' ' * 101)
    with pytest.raises(FormatError, match='over 100 bytes'):
        sd.read_record(step, 1)


def test_a_step_set_aside_by_a_writer_killed_between_its_renames_is_put_back(tmp_path):
    """Without renameat2's exchange the old step is renamed aside first: a writer killed
    before the second rename left no step, and the next manager deleted both copies."""
    import numpy as np

    import jckpt
    options = jckpt.CheckpointOptions(format='npz')
    with jckpt.CheckpointManager(tmp_path, options=options) as mgr:
        mgr.save(1, {'w': np.ones(2, np.float32)})
    step = tmp_path / 'step_00000001.jckpt'
    aside = tmp_path / ('step_00000001.jckpt.jckpt-next.2' + sd.ASIDE_SUFFIX)
    os.rename(step, aside)  # where the kill left it
    (tmp_path / 'step_00000001.jckpt.jckpt-next.2').mkdir()  # and the new one, unpublished
    with jckpt.CheckpointManager(tmp_path, options=options) as mgr:
        assert mgr.all_steps() == [1]
        assert mgr.restore(1).tree['jckpt']['w'].tolist() == [1, 1]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith('.')) == [
        'step_00000001.jckpt']


@pytest.mark.parametrize('model_format', [['npz'], {'a': 1}, 5])
def test_a_record_whose_model_format_is_no_string_is_refused(tmp_path, model_format):
    """A list there reached `jckpt inspect`'s look-up among the registered formats and escaped
    as `TypeError: unhashable type` (found by the manager-directory fuzzer)."""
    import json

    import jckpt
    from jckpt.errors import FormatError
    step = _record(tmp_path, json.dumps({'model': 'model.npz', 'model_format': model_format,
                                         'model_namespace': 'jckpt', 'metadata': {}}).encode())
    with pytest.raises(FormatError, match='not a step record'):
        sd.read_record(step, 1)
    shown = jckpt.info(str(tmp_path)).render()
    assert 'not a step record' in shown
