"""How a manager reads a step (jckpt.services.restoring): with and without its view's knowledge of
the step, its trainer state checked against the layout."""

import numpy as np
import pytest

import jckpt
from jckpt.services.formats import CheckpointLoadOptions
from jckpt.services.restoring import Loaded, Restored, read_step

TREE = {"w": np.arange(4, dtype=np.float32)}


@pytest.fixture
def saved(tmp_path):
    state = jckpt.TrainerState(global_step=3, dp=2)
    with jckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(3, TREE, metrics={"loss": 0.25}, trainer_state=state, metadata={"run": "a"})
    return str(tmp_path / "step_00000003.jckpt")


@pytest.mark.parametrize("folder", [False, None])
def test_a_step_reads_the_same_known_or_not(saved, folder):
    r = read_step(jckpt.Context(), saved, 3, folder, {"w": np.zeros(4, np.float32)},
                  loaded=Loaded(CheckpointLoadOptions()))
    assert isinstance(r, Restored) and r.step == 3
    np.testing.assert_array_equal(r.tree["w"], TREE["w"])
    assert r.metrics == {"loss": 0.25} and r.metadata == {"run": "a"}
    assert r.trainer_state.global_step == 3


def test_a_layout_adapts_the_trainer_state_or_is_refused(saved):
    ctx, opts = jckpt.Context(), CheckpointLoadOptions()
    r = read_step(ctx, saved, 3, False, None, loaded=Loaded(opts, layout=(4, 1, 1)))
    assert r.trainer_state.dp == 4
    with pytest.raises(jckpt.MismatchError):
        read_step(ctx, saved, 3, False, None, loaded=Loaded(opts, layout=(4, 1, 1), reshard=False))


def test_a_step_directory_reads_its_model(tmp_path):
    opts = jckpt.CheckpointOptions(format="npz")
    with jckpt.CheckpointManager(tmp_path, options=opts) as mgr:
        mgr.save(1, items={"model": TREE, "opt": {"m": TREE["w"] * 2}}, metrics={"loss": 1.0})
    r = read_step(jckpt.Context(), str(tmp_path / "step_00000001.jckpt"), 1, True, None,
                  loaded=Loaded(CheckpointLoadOptions(), namespaces=["opt"]))
    assert list(r.tree) == ["opt"] and r.metrics == {"loss": 1.0}
    np.testing.assert_array_equal(r.tree["opt"]["m"], TREE["w"] * 2)


def test_the_manager_reads_through_its_read_side(saved):
    from jckpt.services.restoring import StepReader
    assert issubclass(jckpt.CheckpointManager, StepReader)
    for name in ("all_steps", "latest_step", "best_step", "metrics", "restore"):
        assert getattr(jckpt.CheckpointManager, name) is getattr(StepReader, name)
    with jckpt.CheckpointManager(str(saved).rsplit("/", 1)[0], read_only=True) as reader:
        assert reader.all_steps() == [3] and reader.best_step("loss") == 3
        assert reader.metrics(3) == {"loss": 0.25} and reader.restore().step == 3


def test_best_step_without_a_metric_names_the_directory_and_both_fixes(saved):
    directory = str(saved).rsplit("/", 1)[0]
    with jckpt.CheckpointManager(directory, read_only=True) as reader:
        with pytest.raises(jckpt.InputError, match="best_step needs a metric") as e:
            reader.best_step()
    assert e.value.file == directory
    assert "best_step('loss')" in e.value.fix and "best_metric=" in e.value.fix


def test_a_readers_processes_keep_the_steps_they_all_found():
    """The writer published step 3 between the listings of a reader's two processes: the one
    that found it leaves it out, and the latest step's metadata, read for another step, with
    it (it is read again); a listing the others share is kept as it is."""
    from jckpt.services import restoring, steps

    found = steps.Found({1: {}, 2: {"loss": 0.5}, 3: {}}, frozenset({2, 3}), ({"step": "3"}, None),
                        indexed=frozenset({3}))
    kept = restoring.common_steps(found, [[1, 2], [1, 2, 3]])
    assert (kept.metrics, kept.folders, kept.indexed, kept.latest) == (
        {1: {}, 2: {"loss": 0.5}}, frozenset({2}), frozenset(), None)
    same = steps.Found({1: {}, 2: {}}, frozenset(), ({"step": "2"}, None))
    assert restoring.common_steps(same, [[1, 2], [1, 2, 3]]) is same


def test_a_readers_processes_list_together_and_fail_together(tmp_path, monkeypatch):
    """What each process of a reader lists goes to the others (`agree`), and so does a
    failure to list: the others fail at once rather than at a barrier's timeout."""
    from jckpt.services import restoring, steps
    from jckpt.storage.backend import LOCAL

    with jckpt.CheckpointManager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save(step, TREE)
    told = []

    def agree(what, path, failure, *, process, processes, value):
        told.append((what, path, failure, process, processes, value))
        if failure is not None:
            raise failure
        return [[1], value]
    monkeypatch.setattr(restoring, "agree", agree)
    found = restoring.recovered(LOCAL, str(tmp_path), 1, 2, True)
    assert sorted(found.metrics) == [1] and told == [("listing the steps", str(tmp_path), None,
                                                      1, 2, [1, 2])]
    assert sorted(restoring.recovered(LOCAL, str(tmp_path), 0, 1, False).metrics) == [1, 2]
    broken = jckpt.StorageError("listing failed", file=str(tmp_path))
    monkeypatch.setattr(steps, "recover", lambda *a, **k: (_ for _ in ()).throw(broken))
    with pytest.raises(jckpt.StorageError, match="listing failed"):
        restoring.recovered(LOCAL, str(tmp_path), 1, 2, True)
    assert told[-1][2] is broken and told[-1][5] == []


def test_a_reader_lists_again_when_the_steps_it_listed_were_removed_meanwhile(tmp_path,
                                                                               monkeypatch, caplog):
    """The writer published two steps and its retention removed the two a reader had just
    listed, before the reader read them: the reader found no step at all ("no checkpoint in
    the directory") though the run had two; it lists again, and says nothing of the removed."""
    from jckpt.format.names import step_name
    from jckpt.services import restoring, steps
    from jckpt.storage.backend import LOCAL

    with jckpt.CheckpointManager(tmp_path) as mgr:
        for step in (2, 3):
            mgr.save(step, TREE)
    real, calls = steps.listed, []

    def stale(backend, directory):  # the first listing, made before steps 0 and 1 went
        calls.append(directory)
        return ([step_name(0), step_name(1)], [], None) if len(calls) == 1 else real(backend, directory)
    monkeypatch.setattr(steps, "listed", stale)
    found = restoring.recovered(LOCAL, str(tmp_path), 0, 1, True)
    assert sorted(found.metrics) == [2, 3] and len(calls) == 2
    assert "unreadable" not in caplog.text
    first = steps.scan(LOCAL, str(tmp_path), ([step_name(1), step_name(2)], [], None))
    assert sorted(first.metrics) == [2] and first.vanished == (step_name(1),)


def test_an_argument_one_process_refuses_opening_a_manager_goes_to_the_others_open(tmp_path,
                                                                                    monkeypatch):
    """`CheckpointManager(..., directory_steps=True)` refusing an argument in one process raised
    there alone, before the open the others wait at: they waited out their timeout. Now the
    refusal goes to that meeting as this process's failure, which every process raises."""
    import jax

    from jckpt.services import restoring

    told = []

    def agree(what, path, failure, *, process, processes):
        told.append((what, path, type(failure).__name__, processes))
        if processes == 1:
            raise failure
        raise jckpt.InputError(f"{what} failed in 1 of the run's processes (process 1: ...)")
    monkeypatch.setattr(restoring, "agree", agree)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for read_only, what in ((False, "opening the manager"), (True, "listing the steps")):
        with pytest.raises(jckpt.InputError, match=f"{what} failed in 1 of the run's processes"):
            jckpt.CheckpointManager(tmp_path, directory_steps=True, read_only=read_only,
                                    save_interval_steps=0)
        assert told[-1] == (what, str(tmp_path), "InputError", 2)
    with pytest.raises(jckpt.InputError, match="save_interval_steps must be a positive integer"):
        jckpt.CheckpointManager(tmp_path, directory_steps=False, save_interval_steps=0)
    assert told[-1][3] == 1  # steps of this process alone: no other process waits for it
