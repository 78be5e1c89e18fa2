"""Removing steps whole, and clearing what a killed writer left in a manager's directory."""

import os

import numpy as np
import pytest

import jckpt
from jckpt.format.names import step_name
from jckpt.services import step_removal
from jckpt.services.formats import CheckpointOptions
from jckpt.storage.backend import LOCAL, backend_for


class Killed(BaseException):
    """What a SIGKILL leaves: nothing after this point runs."""


def test_clean_staging_keeps_published_steps_only(tmp_path):
    (tmp_path / 'step_00000001.jckpt').mkdir()
    (tmp_path / 'step_00000001.jckpt' / 'trainer_state.json').write_text('{}')
    (tmp_path / 'step_00000002.jckpt').mkdir()                       # half deleted
    (tmp_path / 'step_00000003.jckpt.jckpt-next.4').mkdir()          # staged, never published
    (tmp_path / 'step_00000005.jckpt.jckpt-next.6').write_bytes(b'')  # a staged file
    (tmp_path / 'other').write_bytes(b'')
    step_removal.clean_staging(backend_for(str(tmp_path)), str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ['other', 'step_00000001.jckpt']


def test_a_step_named_directory_of_somebody_elses_files_is_left(tmp_path, caplog):
    """Opening a manager deleted `step_00000099.jckpt/sub/notes.txt` whole: it had a step's
    name and no index or record."""
    import logging
    (tmp_path / 'step_00000099.jckpt' / 'sub').mkdir(parents=True)
    (tmp_path / 'step_00000099.jckpt' / 'sub' / 'notes.txt').write_text('x')
    (tmp_path / 'step_00000007.jckpt').mkdir()  # what a killed directory save leaves
    (tmp_path / 'step_00000007.jckpt' / 'process_00000.jckpt').write_bytes(b'')
    (tmp_path / 'step_00000007.jckpt' / 'model.npz.jckpt-stage.ab').write_bytes(b'')
    with caplog.at_level(logging.WARNING):
        step_removal.clean_staging(backend_for(str(tmp_path)), str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ['step_00000099.jckpt']
    assert 'holds no index or record but files no manager writes (sub)' in caplog.text


def test_a_step_directory_vanishes_at_once_when_retention_deletes_it(tmp_path, monkeypatch):
    """Retention deleted a step directory's markers, then its files: a kill in between left a
    half-deleted step that the tools reported as damage. It is renamed to a staging name
    first; a kill after the rename leaves only that, which the next manager removes."""
    import subprocess
    import sys
    opts = CheckpointOptions(format='safetensors')
    with jckpt.CheckpointManager(tmp_path, options=opts) as mgr:
        for step in (1, 2):
            mgr.save(step, {'w': np.arange(3.0) + step})
    real = step_removal.formats.staging_remove

    def die_once_renamed(path):
        if os.path.exists(path):
            raise Killed
        real(path)

    monkeypatch.setattr(step_removal.formats, 'staging_remove', die_once_renamed)
    with pytest.raises(Killed):
        step_removal.remove_step(backend_for(str(tmp_path)), str(tmp_path / 'step_00000001.jckpt'))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ['step_00000001.jckpt.jckpt-next.0', 'step_00000002.jckpt']
    verify = subprocess.run([sys.executable, '-m', 'jckpt', 'verify', str(tmp_path)],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    with jckpt.CheckpointManager(tmp_path) as mgr:  # opening cleans the staging up
        assert mgr.all_steps() == [2]
    assert sorted(os.listdir(tmp_path)) == ['step_00000002.jckpt']


def test_remove_step_removes_files_and_directories_whole(tmp_path):
    with jckpt.CheckpointManager(tmp_path, keep_last=1) as mgr:
        mgr.save(1, {'w': np.ones(2)})
        mgr.save(2, {'w': np.ones(2)}, options=CheckpointOptions(format='npz'))
        mgr.save(3, {'w': np.ones(2)})
    assert sorted(os.listdir(tmp_path)) == ['step_00000003.jckpt']


def test_retention_unlinks_a_step_that_is_a_link_and_leaves_its_target(tmp_path):
    """Retention removed the markers inside a linked step's target (a kept copy, say)."""
    run = tmp_path / 'run'
    keep = run / 'kept'
    with jckpt.CheckpointManager(keep, options=CheckpointOptions(format='npz')) as mgr:
        mgr.save(1, {'w': np.ones(2)})
    os.symlink(keep / 'step_00000001.jckpt', run / 'step_00000001.jckpt')
    before = sorted(os.listdir(keep / 'step_00000001.jckpt'))
    with jckpt.CheckpointManager(run, keep_last=1) as mgr:
        assert mgr.all_steps() == [1]
        mgr.save(2, {'w': np.ones(2)})
    assert sorted(os.listdir(run)) == ['kept', 'step_00000002.jckpt']
    assert sorted(os.listdir(keep / 'step_00000001.jckpt')) == before


def test_a_bucket_manager_removes_the_local_files_of_steps_that_never_reached_the_bucket(
        tmp_path, monkeypatch):
    """A manager killed while writing step 3 left its whole staged file in the temporary
    directory; the next one looked only for the steps it found in the bucket."""
    import tempfile

    from jckpt.storage import staging
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    url = "memory://spool/run"
    with jckpt.CheckpointManager(url) as mgr:
        mgr.save(1, {"w": np.ones(2)})
    dead = staging.next_name(f"{url}/step_00000003.jckpt", 7)
    elsewhere = staging.next_name("memory://spool/other/step_00000003.jckpt", 7)
    mirrors = staging.next_name(f"{url}/latest.jckpt", 7)  # a live mirror's, beside the steps
    for path in (dead, elsewhere, mirrors):
        with open(path, "wb") as f:
            f.write(b"x" * 1000)
    assert os.path.dirname(dead) == str(tmp_path)
    with jckpt.CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [1]
    assert not os.path.exists(dead) and os.path.exists(elsewhere) and os.path.exists(mirrors)


def test_remove_steps_says_which_steps_are_gone_as_they_go(tmp_path):
    with jckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {'w': np.ones(2)})
        mgr.save(2, {'w': np.ones(2)}, options=CheckpointOptions(format='npz'))
        mgr.save(3, {'w': np.ones(2)})
    paths = {str(tmp_path / step_name(s)): s == 2 for s in (1, 2)}
    told = []
    step_removal.remove_steps(LOCAL, paths, told.append)
    assert told == [[p] for p in paths] and sorted(os.listdir(tmp_path)) == ['step_00000003.jckpt']


def test_remove_steps_in_a_bucket_removes_the_markers_first(monkeypatch):
    """The markers of every directory step (and the file steps) go in the first request, and
    `gone` is told before what is left of the directory steps is deleted."""
    pytest.importorskip("obstore")
    import obstore
    root = "memory://remove-steps/run"
    with jckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {'w': np.ones(2)})
        mgr.save(2, {'w': np.ones(2)}, options=CheckpointOptions(format='npz'))
        mgr.save(3, {'w': np.ones(2)})
    real, order = obstore.delete, []
    monkeypatch.setattr(obstore, "delete", lambda store, paths: (order.append(sorted(paths)),
                                                                 real(store, paths))[1])
    backend = jckpt.storage.backend_for(root)
    step_removal.remove_steps(backend, {f"{root}/step_00000001.jckpt": False,
                                 f"{root}/step_00000002.jckpt": True}, lambda gone: order.append(gone))
    assert order == [
        ['run/step_00000001.jckpt', 'run/step_00000002.jckpt/index.jckpt',
         'run/step_00000002.jckpt/trainer_state.json'],
        [f"{root}/step_00000001.jckpt", f"{root}/step_00000002.jckpt"],
        ['run/step_00000002.jckpt', 'run/step_00000002.jckpt/model.npz']]
    assert backend.list(root) == ['step_00000003.jckpt']
