"""The checkpoint manager: steps, retention, restore by namespace, trainer state, preemption."""

import errno
import json
import math
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jckpt
from jckpt.services.manager import step_name
from jckpt.storage import writer as writer_mod
from tests.helpers import cpu_mesh


def state_at(step):
    return {"params": {"w": jnp.full((4, 3), float(step))}, "opt": {"mu": jnp.full(3, step * 0.5)},
            "step": jnp.int32(step)}


def test_steps_are_files_published_in_the_background(tmp_path):
    with jckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() is None and mgr.all_steps() == []
        for step in (100, 200, 300):
            assert mgr.save(step, state_at(step), metrics={"loss": 1.0 / step},
                            trainer_state=jckpt.TrainerState(global_step=step, consumed_batches=2 * step,
                                                             learning_rate=1e-3, user={"seed": 7}))
        assert mgr.wait_durable(timeout=60)
        assert mgr.all_steps() == [100, 200, 300] and mgr.latest_step() == 300
        assert str(mgr.counters) == ("memory mirror: committed 3 durable 3 generation 3 "
                                     "pending 0 error 0")
        r = mgr.restore(target=state_at(0))
        assert r.step == 300 and int(r.tree["step"]) == 300
        np.testing.assert_array_equal(r.tree["params"]["w"], np.full((4, 3), 300.0))
        assert r.trainer_state == jckpt.TrainerState(global_step=300, consumed_batches=600,
                                                     learning_rate=1e-3, user={"seed": 7})
        assert r.metrics == {"loss": pytest.approx(1 / 300)}
        assert mgr.restore(100, target=state_at(0)).tree["params"]["w"][0, 0] == 100
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith("step_"))
    assert names == [step_name(s) for s in (100, 200, 300)] == [
        "step_00000100.jckpt", "step_00000200.jckpt", "step_00000300.jckpt"]
    md = jckpt.describe(tmp_path / names[-1]).metadata_dict()
    assert md["jckpt.step"] == "300" and json.loads(md["jckpt.trainer_state"])["global_step"] == 300
    assert not os.path.exists(tmp_path / ".jckpt-lease")


def test_a_manager_no_variable_refers_to_is_named_as_this_processs(tmp_path):
    """A notebook cell `mgr = jckpt.CheckpointManager(d)` run again: the first manager's
    threads keep it and its lease alive, and the refusal named the notebook's own pid as
    "another writer", with a fix (close it) that nothing could reach."""
    import gc

    mgr = jckpt.CheckpointManager(tmp_path)
    mgr.save(1, {"w": np.ones(2, np.float32)}, force=True)
    first, mgr = mgr, None
    gc.collect()
    with pytest.raises(jckpt.InUseError, match=r"a writer of this process \(pid \d+\) holds "
                                               r"the lease .*opened on this path earlier") as e:
        jckpt.CheckpointManager(tmp_path)
    assert "mgr.close()" in e.value.fix and "restart" in e.value.fix
    first.close()
    jckpt.CheckpointManager(tmp_path).close()


@pytest.mark.parametrize("read_only", [False, True])
def test_a_manager_given_a_checkpoint_file_says_it_is_a_file(tmp_path, read_only):
    """A step file passed where the run's directory goes: a writer failed with the bare "File
    exists" of the directory it could not create (its fix: "see the underlying OS error"),
    and a reader called it "no such directory"."""
    path = tmp_path / "step_00000001.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.ones(2, np.float32)}, path)
    with pytest.raises(jckpt.InputError, match="is a file, not a directory") as e:
        jckpt.CheckpointManager(path, read_only=read_only)
    assert e.value.file == str(path) and "jckpt.restore" in e.value.fix
    assert jckpt.restore(jckpt.Context(), {"w": np.zeros(2, np.float32)}, path)["w"].sum() == 2


def test_retention_last_every_best_and_never_the_latest(tmp_path):
    losses = {s: 1.0 / s for s in range(1, 13)}
    losses[3] = 0.001          # the best loss, early
    losses[12] = 9.0           # the latest is the worst
    with jckpt.CheckpointManager(tmp_path, keep_last=2, keep_every=5, keep_best=1,
                                 best_metric="loss") as mgr:
        for s in range(1, 13):
            mgr.save(s, {"x": np.float32(s)}, metrics={"loss": losses[s]})
        mgr.wait_durable()
        assert mgr.all_steps() == [3, 5, 10, 11, 12]
        assert mgr.best_step() == 3
        assert mgr.best_step(metric="loss", mode="max") == 12
    with jckpt.CheckpointManager(tmp_path, keep_best=1, best_metric="acc", best_mode="max") as mgr:
        assert mgr.all_steps() == [3, 5, 10, 11, 12]
        mgr.save(13, {"x": np.float32(13)}, metrics={"acc": 0.5})
        mgr.save(14, {"x": np.float32(14)}, metrics={"acc": 0.1})
        mgr.wait_durable()
        # Best by acc is 13; the latest durable (14) is always kept; steps without the metric go.
        assert mgr.all_steps() == [13, 14]


def test_restoring_a_step_retention_deleted_says_so(tmp_path):
    with jckpt.CheckpointManager(tmp_path, keep_last=1) as mgr:
        for s in (1, 2):
            mgr.save(s, {"x": np.float32(s)})
        mgr.wait_durable()
        with pytest.raises(jckpt.FormatError, match="no step 1: retention deleted it") as e:
            mgr.restore(1)
        assert "pick one of [2]" in e.value.fix
        with pytest.raises(jckpt.FormatError, match=r"no step 3 \(") as e:  # never saved
            mgr.restore(3)


def test_interval_force_and_increasing_steps(tmp_path):
    with jckpt.CheckpointManager(tmp_path, save_interval_steps=10, asynchronous=False) as mgr:
        assert [mgr.save(s, {"x": np.float32(s)}) for s in range(1, 21)].count(True) == 2
        assert mgr.all_steps() == [10, 20]              # synchronous: durable on return
        assert mgr.save(23, {"x": np.float32(23)}, force=True)
        with pytest.raises(jckpt.InputError, match="not above"):
            mgr.save(20, {"x": np.float32(0)}, force=True)
        with pytest.raises(jckpt.InputError, match="exactly one"):
            mgr.save(30)
        assert mgr.all_steps() == [10, 20, 23]


def test_incomplete_steps_are_ignored_and_cleaned(tmp_path):
    with jckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": np.float32(1)})
    stage = tmp_path / (step_name(2) + ".jckpt-stage.0000abcd.00000001.0123456789abcdef")
    stage.write_bytes(b"\0\0\0\x10partial")            # a killed writer's staging file
    unsynced = tmp_path / (step_name(2) + ".jckpt-next.4")
    unsynced.write_bytes(b"written, never made durable")
    unsynced_stage = tmp_path / (step_name(2) + ".jckpt-next.5"
                                 ".jckpt-stage.00000001.00000002.0123456789abcdef")
    unsynced_stage.write_bytes(b"being written")
    (tmp_path / step_name(3)).write_bytes(b"\0\0")     # an unreadable step file
    (tmp_path / "notes.txt").write_text("kept")
    with jckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [1] and mgr.latest_step() == 1
        assert int(mgr.restore(target={"x": np.float32(0)}).tree["x"]) == 1
    assert not stage.exists() and not unsynced.exists() and not unsynced_stage.exists()
    assert (tmp_path / "notes.txt").exists()


def test_restore_namespaces_without_the_optimizer(tmp_path):
    with jckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(5, items={"model": {"w": jnp.ones((2, 2))}, "opt": {"mu": jnp.zeros(2)}})
        mgr.wait_durable()
        only = mgr.restore(namespaces=["model"]).tree
        assert set(only) == {"model"}
        np.testing.assert_array_equal(only["model"]["w"], np.ones((2, 2)))
        both = mgr.restore().tree
        assert set(both) == {"model", "opt"}
        targeted = mgr.restore(target={"model": {"w": jax.ShapeDtypeStruct((2, 2), jnp.float32)}},
                               namespaces=["model"]).tree
        assert targeted["model"]["w"].shape == (2, 2)
        with pytest.raises(jckpt.MissingEntryError, match="no namespace 'optimizer'"):
            mgr.restore(namespaces=["optimizer"])
        mgr.save(6, state_at(6))
        mgr.wait_durable()
        partial = mgr.restore(target={"params": state_at(0)["params"]}).tree  # no optimizer read
        assert set(partial) == {"params"}


@pytest.mark.parametrize('options', [None, jckpt.CheckpointOptions(format='npz')])
def test_a_nan_loss_in_the_trainer_state_survives_a_save_as_strict_json(tmp_path, options):
    """The trainer state of a step whose loss went NaN is read back as NaN, and every JSON
    parser can read what was stored (the header's metadata, or trainer_state.json)."""
    state = jckpt.TrainerState(global_step=3, best_loss=float('nan'),
                               user={'loss': float('nan'), 'grad_norm': float('inf')})
    with jckpt.CheckpointManager(tmp_path, options=options) as mgr:
        mgr.save(3, {'w': np.ones(2, np.float32)}, trainer_state=state)
        mgr.wait_durable()
        r = mgr.restore()
    assert math.isnan(r.trainer_state.best_loss) and math.isnan(r.trainer_state.user['loss'])
    assert r.trainer_state.user['grad_norm'] == math.inf
    step = tmp_path / 'step_00000003.jckpt'
    text = ((step / 'trainer_state.json').read_text() if step.is_dir()
            else jckpt.describe(step).metadata_dict()['jckpt.trainer_state'])
    json.loads(text, parse_constant=lambda token: pytest.fail(f"{token} is not strict JSON"))


@pytest.mark.parametrize('options', [None, jckpt.CheckpointOptions(format='npz')])
def test_nan_metrics_are_stored_as_strict_json_and_read_back(tmp_path, options):
    """A NaN loss passed as a metric was written as the bare token `NaN` in the step's
    metadata and its trainer_state.json, which strict JSON parsers refuse."""
    from jckpt.format.names import METRICS_KEY

    with jckpt.CheckpointManager(tmp_path, options=options, best_metric='loss') as mgr:
        mgr.save(1, {'w': np.ones(2, np.float32)}, metrics={'loss': 0.5})
        mgr.save(2, {'w': np.ones(2, np.float32)}, metrics={'loss': math.nan, 'acc': -math.inf})
        mgr.wait_durable()
    step = tmp_path / 'step_00000002.jckpt'
    texts = ([(step / 'trainer_state.json').read_text()] if step.is_dir()
             else [jckpt.describe(step).metadata_dict()[METRICS_KEY]])
    for text in texts:
        json.loads(text, parse_constant=lambda token: pytest.fail(f"{token} is not strict JSON"))
    with jckpt.CheckpointManager(tmp_path, options=options, best_metric='loss') as mgr:
        metrics = mgr.metrics(2)
        assert math.isnan(metrics['loss']) and metrics['acc'] == -math.inf
        assert mgr.best_step() == 1  # a NaN metric is never the best
        assert math.isnan(mgr.restore(2).metrics['loss'])


def test_resume_on_another_layout_reshards_or_refuses(tmp_path):
    mesh2 = cpu_mesh((2,), ("dp",))
    spec = jax.sharding.PartitionSpec("dp")
    w = jax.device_put(jnp.arange(16.0).reshape(8, 2), jax.sharding.NamedSharding(mesh2, spec))
    with jckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(7, {"w": w}, trainer_state=jckpt.TrainerState(global_step=7, dp=2))
        mgr.wait_durable()
        with pytest.raises(jckpt.MismatchError, match="dp=2 tp=1 pp=1, this run uses dp=8") as info:
            mgr.restore(target={"w": w}, layout=(8, 1, 1), reshard=False)
        assert "reshard=True" in str(info.value)
        mesh8 = cpu_mesh((8,), ("dp",))
        target = {"w": jax.ShapeDtypeStruct((8, 2), jnp.float32,
                                            sharding=jax.sharding.NamedSharding(mesh8, spec))}
        r = mgr.restore(target=target, layout=(8, 1, 1))
        assert r.trainer_state.layout == (8, 1, 1) and r.trainer_state.global_step == 7
        assert r.tree["w"].sharding == target["w"].sharding
        np.testing.assert_array_equal(r.tree["w"], w)
        same = mgr.restore(target={"w": w}, layout=jckpt.TrainerState(dp=2), reshard=False)
        assert same.trainer_state.dp == 2


def test_preemption_falls_back_without_a_distributed_client(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with jckpt.CheckpointManager(tmp_path, save_interval_steps=100, handle_sigterm=True) as mgr:
            assert not mgr.reached_preemption(3) and not mgr.should_save(3)
            os.kill(os.getpid(), signal.SIGTERM)
            # step 3's save was decided before the signal: not reached until it is asked again
            assert not mgr.reached_preemption(3)
            assert mgr.should_save(3) and mgr.reached_preemption(3)
            assert mgr.save(3, {"x": np.float32(3)})
            mgr.wait_durable()
            assert mgr.all_steps() == [3]
        assert signal.getsignal(signal.SIGTERM) is previous  # close puts the old handler back
    finally:
        signal.signal(signal.SIGTERM, previous)
    with jckpt.CheckpointManager(tmp_path) as mgr:
        assert not mgr.reached_preemption(4)


def test_second_manager_on_a_directory_is_refused(tmp_path):
    with jckpt.CheckpointManager(tmp_path):
        with pytest.raises(jckpt.InUseError, match="in use"):
            jckpt.CheckpointManager(tmp_path)
        with pytest.raises(jckpt.InUseError, match="in use"):
            jckpt.CheckpointManager(str(tmp_path) + "/")


def full_disk(monkeypatch, *, on: bool) -> dict:
    """Make the writer's every write fail with ENOSPC while the returned switch's "on" is set."""
    original = writer_mod.Sink.write
    broken = {"on": on}

    def write(sink, data):
        if broken["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(sink, data)

    monkeypatch.setattr(writer_mod.Sink, "write", write)
    return broken


def test_disk_error_keeps_the_step_and_retries(tmp_path, monkeypatch):
    broken = full_disk(monkeypatch, on=False)
    with jckpt.CheckpointManager(tmp_path, retry_after=0.02, patience=10**6) as mgr:
        mgr.save(1, {"x": np.float32(1)})
        mgr.wait_durable()
        broken["on"] = True
        mgr.save(2, {"x": np.float32(2)})
        assert not mgr.wait_durable(timeout=0.3)
        assert mgr.counters.error == "ENOSPC" and mgr.counters.pending == 1
        assert mgr.all_steps() == [1]
        broken["on"] = False
        assert mgr.wait_durable(timeout=30)
        assert mgr.all_steps() == [1, 2] and mgr.counters.error == 0


def test_a_full_manager_says_to_save_less_often(tmp_path, monkeypatch):
    """Its CapacityError told the manager's user to "submit less often", a mirror's call."""
    import threading
    gate, original = threading.Event(), writer_mod.Sink.write
    monkeypatch.setattr(writer_mod.Sink, "write", lambda sink, data: (gate.wait(30), original(sink, data))[1])
    with jckpt.CheckpointManager(tmp_path, slots=1, when_full="raise") as mgr:
        mgr.save(1, {"x": np.float32(1)})  # held by the writer until the gate opens
        with pytest.raises(jckpt.CapacityError, match="slots") as info:
            mgr.save(2, {"x": np.float32(2)})
        gate.set()
    fix = info.value.fix
    assert fix.startswith("save less often") and "submit" not in fix
    assert "save_interval_steps" in fix and "should_save(step)" in fix and "when_full='block'" in fix
    assert mgr.all_steps() == [1]


def held_writes(monkeypatch):
    """An event every later write to a checkpoint file waits for (30 s at most)."""
    import threading
    gate, original = threading.Event(), writer_mod.Sink.write
    monkeypatch.setattr(writer_mod.Sink, "write", lambda sink, data: (gate.wait(30), original(sink, data))[1])
    return gate


@pytest.mark.parametrize("asked", [2, None])
def test_a_step_the_manager_is_still_writing_is_waited_for_before_it_is_read(tmp_path, monkeypatch, asked):
    """`save(2)` then `restore(2)` (or `restore()`) read step 2: it raised "no step 2", and
    `restore()` read step 1, while the writer was still writing step 2."""
    import threading
    with jckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": np.float32(1)})
        mgr.wait_durable()
        gate = held_writes(monkeypatch)
        mgr.save(2, {"x": np.float32(2)})  # held by the writer until the gate opens
        assert mgr.counters.pending == 1 and mgr.all_steps() == [1]
        threading.Timer(0.2, gate.set).start()
        restored = mgr.restore(asked)
        assert restored.step == 2 and restored.tree["jckpt"]["x"] == 2
        assert mgr.restore(1).step == 1  # a durable step: read as it is


def test_a_read_only_manager_reads_the_latest_durable_step_of_a_writer_still_writing(tmp_path, monkeypatch):
    with jckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": np.float32(1)})
        mgr.wait_durable()
        gate = held_writes(monkeypatch)
        mgr.save(2, {"x": np.float32(2)})
        try:
            with jckpt.CheckpointManager(tmp_path, read_only=True) as reader:
                assert reader.restore().step == 1  # what is durable, without waiting for anyone
        finally:
            gate.set()


def test_a_step_written_after_a_disk_error_was_raised_waits_normally(tmp_path, monkeypatch):
    """After a full disk made `wait_durable` raise, a step saved once the disk had room again
    raised the same ENOSPC again, until the failed step's retry (`retry_after` later) went
    through; the error is raised once, and the next wait writes both steps at once."""
    broken = full_disk(monkeypatch, on=True)
    with jckpt.CheckpointManager(tmp_path, retry_after=600, patience=1) as mgr:
        mgr.save(1, {"x": np.float32(1)})
        with pytest.raises(jckpt.StorageError, match="No space") as e:
            mgr.wait_durable(timeout=30)
        assert e.value.errno == errno.ENOSPC and step_name(1) in str(e.value)
        broken["on"] = False
        mgr.save(2, {"x": np.float32(2)})
        assert mgr.wait_durable(timeout=30)
        assert mgr.all_steps() == [1, 2] and mgr.counters.error == 0


def test_a_failed_directory_step_shows_in_the_counters_like_a_failed_file_step(
        tmp_path, monkeypatch):
    """A directory step's failed save counted in `failures` but left `error 0`."""
    broken = full_disk(monkeypatch, on=False)
    with jckpt.CheckpointManager(tmp_path, directory_steps=True) as mgr:
        mgr.save(1, {"x": np.float32(1)})
        broken["on"] = True
        with pytest.raises(jckpt.StorageError, match="No space") as e:
            mgr.save(2, {"x": np.float32(2)})
        assert step_name(2) in str(e.value)
        assert mgr.counters.error == "ENOSPC" and mgr.counters.failures == 1
        assert mgr.wait_durable(timeout=30)             # raised by the save, not again
        broken["on"] = False
        mgr.save(3, {"x": np.float32(3)})
        assert str(mgr.counters).endswith("error 0") and mgr.all_steps() == [1, 3]


def test_lineage_and_generation_continue_across_runs(tmp_path):
    with jckpt.CheckpointManager(tmp_path, lineage="exp1") as mgr:
        mgr.save(1, {"x": np.float32(1)})
    with pytest.raises(jckpt.LineageError, match="exp1") as info:
        jckpt.CheckpointManager(tmp_path, lineage="exp2")
    assert info.value.file == str(tmp_path / step_name(1)) and "new_lineage=True" in str(info.value)
    with jckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.lineage == "exp1" and mgr.counters.generation == 1
        mgr.save(2, {"x": np.float32(2)})
    md = jckpt.describe(tmp_path / step_name(2)).metadata_dict()
    assert md["jckpt.lineage"] == "exp1" and md["jckpt.generation"] == "2"
    with jckpt.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(jckpt.FormatError, match="no step 9"):
            mgr.restore(9)
    with jckpt.CheckpointManager(tmp_path / "empty") as mgr:
        with pytest.raises(jckpt.FormatError, match="no checkpoint"):
            mgr.restore()


def test_a_directory_of_another_run_is_refused_unless_a_new_lineage_is_asked(tmp_path):
    jckpt.save(jckpt.Context(), {"x": np.float32(1)}, tmp_path / step_name(1))  # no lineage
    with pytest.raises(jckpt.LineageError, match="not written by a checkpoint manager") as info:
        jckpt.CheckpointManager(tmp_path)
    assert info.value.file == str(tmp_path / step_name(1)) and "new_lineage=True" in str(info.value)
    with jckpt.CheckpointManager(tmp_path, lineage="exp2", new_lineage=True, keep_last=1) as mgr:
        assert mgr.lineage == "exp2" and mgr.counters.generation == 0
        with pytest.raises(jckpt.InputError, match="not above"):
            mgr.save(1, {"x": np.float32(0)})     # the earlier run's steps stay: go above them
        mgr.save(2, {"x": np.float32(2)})
        mgr.wait_durable()
        assert mgr.all_steps() == [2]             # and they count for retention
    md = jckpt.describe(tmp_path / step_name(2)).metadata_dict()
    assert md["jckpt.lineage"] == "exp2" and md["jckpt.generation"] == "1"
    with jckpt.CheckpointManager(tmp_path) as mgr:  # the latest step is now this run's: continued
        assert mgr.lineage == "exp2" and mgr.counters.generation == 1


def test_directory_steps_for_multi_process_saves(tmp_path):
    mesh = cpu_mesh((8,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    with jckpt.CheckpointManager(tmp_path, directory_steps=True, keep_last=2) as mgr:
        for step in (1, 2, 3):
            w = jax.device_put(jnp.full((8, 2), float(step)), sharding)
            assert mgr.save(step, {"w": w}, metrics={"loss": 1.0 / step},
                            trainer_state=jckpt.TrainerState(global_step=step, dp=8))
        assert mgr.all_steps() == [2, 3]
        assert os.path.isdir(tmp_path / step_name(3))
        assert str(mgr.counters) == ("memory mirror: committed 3 durable 3 generation 3 "
                                     "pending 0 error 0")
        target = {"w": jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=sharding)}
        r = mgr.restore(target=target)
        assert r.step == 3 and r.trainer_state.dp == 8 and r.metrics == {"loss": pytest.approx(1 / 3)}
        np.testing.assert_array_equal(r.tree["w"], np.full((8, 2), 3.0))
        assert r.tree["w"].sharding == sharding
        np.testing.assert_array_equal(mgr.restore(2, namespaces=["jckpt"]).tree["jckpt"]["w"],
                                      np.full((8, 2), 2.0))
        with pytest.raises(jckpt.InputError, match="one namespace"):
            mgr.save(4, items={"a": {"w": w}})
    # A directory whose deletion was interrupted (no index) and a dead save's staging directory.
    half = tmp_path / step_name(9)
    half.mkdir()
    (half / "process_00000.jckpt").write_bytes(b"x")
    stage = tmp_path / (step_name(10) + ".jckpt-stage-dir.0123456789abcdef")
    stage.mkdir()
    (stage / ".writer.lock").write_bytes(b"")
    with jckpt.CheckpointManager(tmp_path, directory_steps=True) as mgr:
        assert mgr.all_steps() == [2, 3] and mgr.counters.generation == 3
    assert not half.exists() and not stage.exists()


@pytest.mark.parametrize("options, match", [
    ({"handle_sigterm": "yes"}, "handle_sigterm must be True or False"),
    ({"asynchronous": "no"}, "asynchronous must be True or False"),
    ({"new_lineage": "yes"}, "new_lineage must be True or False"),
    ({"best_metric": 3}, "best_metric must be a metric's name"),
    ({"best_metric": "", "keep_best": 1}, "best_metric must be a metric's name"),
    ({"save_interval_steps": True}, "save_interval_steps must be a positive integer"),
])
def test_manager_options_of_the_wrong_kind_are_refused(tmp_path, options, match):
    with pytest.raises(jckpt.InputError, match=match):
        jckpt.CheckpointManager(tmp_path / "run", **options)
    with jckpt.CheckpointManager(tmp_path / "run") as mgr:  # the lease was given back
        assert mgr.all_steps() == []


def test_manager_calls_refuse_bad_steps_flags_and_timeouts(tmp_path):
    with jckpt.CheckpointManager(tmp_path / "run") as mgr:
        for bad in ("x", -1, 1.5, True):
            with pytest.raises(jckpt.InputError, match="step must be a non-negative integer"):
                mgr.reached_preemption(bad)
        with pytest.raises(jckpt.InputError, match="force must be True or False"):
            mgr.save(1, {"w": jnp.ones(2)}, force="yes")
        with pytest.raises(jckpt.InputError, match="timeout must be >= 0 seconds"):
            mgr.wait_durable(timeout=-1)
        assert mgr.save(1, {"w": jnp.ones(2)}) and mgr.wait_durable(timeout=60)
        assert mgr.all_steps() == [1]


def test_numpy_and_jax_steps_are_ints(tmp_path):
    """`mgr.save(state.step, state)`: a JAX step was admitted, then failed the writer with
    "unhashable type" and every later step was lost; a numpy step was listed as np.int64."""
    with jckpt.CheckpointManager(tmp_path / "run", best_metric="loss") as mgr:
        assert mgr.should_save(jnp.int32(1))
        assert mgr.save(jnp.int32(1), {"w": jnp.ones(2)}, metrics={"loss": 1.0})
        assert mgr.save(np.int64(2), {"w": jnp.ones(2)}, metrics={"loss": 0.5})
        assert mgr.save(3, {"w": jnp.ones(2)}, metrics={"loss": 2.0})
        assert mgr.wait_durable(timeout=60)
        assert mgr.all_steps() == [1, 2, 3] and all(type(s) is int for s in mgr.all_steps())
        assert mgr.metrics(jnp.int32(2)) == {"loss": 0.5} and mgr.best_step() == 2
        restored = mgr.restore(jnp.int32(2))
        assert type(restored.step) is int and restored.step == 2
    assert sorted(os.listdir(tmp_path / "run")) == [step_name(s) for s in (1, 2, 3)]


def test_mirror_refuses_negative_timeouts(tmp_path):
    with jckpt.Mirror(tmp_path / "m.jckpt") as mirror:
        with pytest.raises(jckpt.InputError, match="timeout must be >= 0 seconds"):
            mirror.wait_durable(timeout=-1)
        with pytest.raises(jckpt.InputError, match="timeout must be >= 0 seconds"):
            mirror.submit({"w": jnp.ones(2)}, timeout=-1)
        mirror.submit({"w": jnp.ones(2)})
        assert mirror.wait_durable(timeout=float("inf"))
    assert jckpt.restore(jckpt.Context(), {"w": jnp.zeros(2)}, tmp_path / "m.jckpt")["w"].sum() == 2


def test_a_manager_over_orbax_steps_says_how_to_read_them(tmp_path, caplog):
    for step in (0, 10):
        (tmp_path / str(step)).mkdir()
        (tmp_path / str(step) / "_CHECKPOINT_METADATA").write_text("{}")
    with caplog.at_level("WARNING", logger="jckpt"):
        with jckpt.CheckpointManager(tmp_path) as mgr:
            assert mgr.all_steps() == []
        jckpt.CheckpointManager(tmp_path).close()  # said once per directory
    said = [r.message for r in caplog.records if "orbax steps" in r.message]
    assert len(said) == 1 and "[0, 10]" in said[0] and str(tmp_path / "10") in said[0]


def test_a_single_process_manager_refuses_a_directory_a_multi_process_run_writes(tmp_path):
    """Their leases differ (the directory's, or one per process): each asks the other's."""
    from jckpt.storage.lease import WriterLease, leases
    with WriterLease(tmp_path / ".process00001"):  # process 1 of a run writing there
        with pytest.raises(jckpt.InUseError, match=r"\.process00001\.jckpt-lease"):
            jckpt.CheckpointManager(tmp_path, keep_last=1)
    with jckpt.CheckpointManager(tmp_path) as mgr:  # free again
        mgr.save(1, {"w": np.ones(2)})
    assert leases(str(tmp_path), 1, 2) == (str(tmp_path / ".process00001"),
                                                 [str(tmp_path / ".jckpt-lease")])


@pytest.mark.parametrize('fmt', ['jckpt', 'npz'])
def test_restore_verifies_what_it_reads_by_default(tmp_path, fmt):
    """A resume from silently damaged optimizer moments is what checksums are for: the manager
    checks every payload it reads (its mapping is not trusted), unless told not to."""
    opts = jckpt.CheckpointOptions(format=fmt)
    with jckpt.CheckpointManager(tmp_path, options=opts) as mgr:
        mgr.save(1, items={'model': {'w': np.zeros(4)}, 'opt': {'m': np.zeros(4)}})
        mgr.wait_durable()
    step = tmp_path / 'step_00000001.jckpt'
    damaged = step if fmt == 'jckpt' else step / 'optimizer.jckpt'
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with jckpt.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(jckpt.ChecksumError, match="opt/m"):
            mgr.restore()
        with pytest.raises(jckpt.ChecksumError):
            mgr.restore(target={'m': np.zeros(4)}, ctx=jckpt.Context(namespace='opt'))
        assert mgr.restore(verify=False).tree['opt']['m'][-1] != 0  # asked for: read as it is
        with pytest.raises(jckpt.InputError, match="verify must be True or False"):
            mgr.restore(verify=None)


def test_a_failed_local_deletion_keeps_the_step_listed_and_the_next_save_deletes_it(
        tmp_path, monkeypatch, caplog):
    """docs/manager.md: a deletion that fails is a warning naming what it was deleting, the
    save stands, the step stays listed and restorable, and the next save's retention deletes it."""
    import logging

    from jckpt.services import step_removal

    remove, failed = step_removal.remove_step, []

    def flaky(backend, path, *, folder=False):
        if not failed:
            failed.append(path)
            raise jckpt.StorageError("permission denied", file=path)
        return remove(backend, path, folder=folder)

    monkeypatch.setattr(step_removal, "remove_step", flaky)
    with jckpt.CheckpointManager(tmp_path, keep_last=1, asynchronous=False) as mgr:
        mgr.save(1, state_at(1))
        with caplog.at_level(logging.WARNING, logger="jckpt"):
            assert mgr.save(2, state_at(2))
        [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert "retention" in warning and step_name(1) in warning and "permission denied" in warning
        assert mgr.all_steps() == [1, 2] and mgr.latest_step() == 2
        assert float(mgr.restore(1).tree["jckpt"]["step"]) == 1
        mgr.save(3, state_at(3))
        assert mgr.all_steps() == [3]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == [step_name(3)]


def test_a_lone_surrogate_in_metadata_is_refused_at_save(tmp_path):
    """It was accepted, and the step failed later in the background with no key named."""
    with jckpt.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(jckpt.InputError, match="the key of metadata key 'x"):
            mgr.save(1, {'a': np.ones(2)}, metadata={os.fsdecode(b'x\xff'): 'v'}, force=True)
        assert mgr.save(2, {'a': np.ones(2)}, metadata={'x': 'v'}, force=True)
    with jckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [2]


def test_a_lone_surrogate_in_a_tree_key_is_refused_at_save(tmp_path):
    """save returned, and the background write failed at the next call or at close."""
    with jckpt.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(jckpt.InputError, match='lone surrogate') as e:
            mgr.save(1, {os.fsdecode(b'w\xff'): np.ones(2)}, force=True)
        assert e.value.entry == 'jckpt/w\\udcff' and 'step_00000001' in e.value.file
        assert mgr.save(2, {'w': np.ones(2)}, force=True)
    with jckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [2]
