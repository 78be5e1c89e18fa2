"""Stateful tests of `CheckpointManager` and `Mirror` against a model, with injected faults.

Hypothesis drives each writer through random sequences of rules (saves of jckpt and
foreign-format steps, waits, restores, listings, reopening from disk, faults) and checks,
after every rule, what `docs/manager.md`, `docs/mirror.md` and `docs/reliability.md`
promise:

* the newest step the manager lists restores bit for bit to what was saved at that step
  (and so does every other step listed), and no published step is lost or damaged by a
  later failure;
* retention keeps exactly what the policy keeps, applied after each step is durable, and
  never the newest durable step;
* the counters line matches the model (`committed N durable N generation N pending N error N`);
* a manager opened again on the directory lists the same steps, continues the generation,
  and removes what a killed writer left (staged steps, staging files, a step directory
  that never got its record);
* every error is a `jckpt.CheckpointError` naming the file and a fix.

Faults: a full disk (`ENOSPC` from the writer), the storage failing before or after the
rename that publishes a step (an upload failing, in a bucket), retention's deletions
failing, a background writer thread that dies, a model writer callback that raises (the
step is dropped, the rest go on), and a killed writer's leftovers.

The local runs are small for CI; `JCKPT_STATES_SCALE=20` runs twenty times the examples.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import jckpt
from jckpt.format.names import NEXT_TAG, STAGE_DIR_TAG, STAGE_TAG, step_name
from jckpt.services import engine, step_removal
from jckpt.storage import backend as backend_mod
from jckpt.storage import directory as directory_mod
from jckpt.storage import staging, step_directory
from jckpt.storage import writer as writer_mod
from tests.properties import STATES_SCALE, state_settings

STATS: collections.Counter = collections.Counter()  # rules run, by machine (printed by hand runs)
HOST = jckpt.Context(host=True)
POLICIES = [
    {},
    {"keep_last": 2},
    {"keep_last": 1, "keep_every": 4},
    {"keep_last": 1, "keep_best": 1, "best_metric": "loss"},
    {"keep_best": 2, "best_metric": "loss", "best_mode": "max"},
]
FORMATS = ["jckpt", "npz", "safetensors", "raw"]
ERRNO = {"disk_full": "ENOSPC", "fsync_file": "EIO", "fsync_dir": "EIO", "upload": "EIO",
         "upload_lost": "EIO"}  # the counters' `error` of each fault


# --- what is saved, and how it is compared -----------------------------------------------------

def tree_for(seed: int) -> dict:
    """A small tree of a few dtypes whose values come from `seed` (bit for bit reproducible)."""
    rng = np.random.default_rng(seed)
    return {"model": {"w": rng.standard_normal(int(rng.integers(1, 40))).astype(np.float32)},
            "opt": {"mu": rng.integers(-9, 9, (2, 3)).astype(np.int32),
                    "count": np.uint8(seed % 251)}}


def flat(tree, prefix=()) -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, (*prefix, key)).items()}
    return {prefix: np.asarray(tree)}


def assert_same(got, want, what: str) -> None:
    g, w = flat(got), flat(want)
    assert sorted(g) == sorted(w), (what, sorted(g), sorted(w))
    for k in w:
        assert g[k].dtype == w[k].dtype and g[k].shape == w[k].shape, (what, k)
        assert g[k].tobytes() == w[k].tobytes(), (what, k, g[k], w[k])


def write_raw(tree, path):
    if RAW_POISON.is_set():
        raise ValueError("the model writer was told to fail")
    tree["w"].tofile(path)


def read_raw(path):
    backend = backend_mod.backend_for(path)  # a step in a bucket is given as its URL
    return {"w": np.frombuffer(backend.head(path, backend.size(path)), np.float32).copy()}


RAW_POISON = threading.Event()
RAW_LOAD = jckpt.CheckpointLoadOptions(model_loader=read_raw)


def options_for(fmt: str) -> jckpt.CheckpointOptions:
    if fmt == "raw":
        return jckpt.CheckpointOptions(format="raw", model_writer=write_raw)
    return jckpt.CheckpointOptions(format=fmt)


def check_error(e: BaseException, *names: str) -> None:
    """A fault's error: a `CheckpointError` whose message names the file (or one of `names`) and a fix."""
    assert isinstance(e, jckpt.CheckpointError), repr(e)
    text = str(e)
    assert any(n in text for n in names), (text, names)
    assert "fix:" in text, text


@dataclasses.dataclass(frozen=True)
class Saved:
    tree: dict
    fmt: str
    metrics: dict
    trainer: jckpt.TrainerState | None
    metadata: dict


# --- faults --------------------------------------------------------------------------------------

class Faults:
    """Patches of the storage layer that fail on purpose while on (`with faults.on(kind)`)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self.calls = 0

    def patch(self, owner, name: str, make: Callable) -> None:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._undo.append(lambda: setattr(owner, name, original))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    @contextlib.contextmanager
    def on(self, kind: str, *, after: int = 0, once: bool = False) -> Iterator[None]:
        """Fail every call of the patched function from the `after`-th on, while in the block
        (`once`: that call alone, a fault that passes)."""
        self.calls = 0

        def failing(original, err, *, done=False):
            """`original`, failing from the `after`-th call on: before it does its work, or
            with `done` after (a request whose answer is lost)."""
            def call(*a, **kw):
                self.calls += 1
                if self.calls <= after or (once and self.calls > after + 1):
                    return original(*a, **kw)
                if done:
                    original(*a, **kw)
                raise err(*a)
            return call

        def enospc(*_):
            return OSError(errno.ENOSPC, "No space left on device")

        def eio(*_):
            return OSError(errno.EIO, "Input/output error")

        def storage(*a):  # as the object store backend raises it: naming what it was writing
            target = a[-1] if isinstance(a[-1], str) else ", ".join(a[-1])
            return jckpt.StorageError("uploading failed: injected", errno=errno.EIO, file=target,
                                      fix="check the network and the bucket, then save again")
        if kind == "disk_full":
            self.patch(writer_mod.Sink, "write", lambda o: failing(o, enospc))
        elif kind == "fsync_file":  # before the rename that publishes
            for module in (staging, step_directory):
                self.patch(module, "fsync_file", lambda o: failing(o, eio))
        elif kind == "fsync_dir":  # a file step: after its rename
            for module in (staging, step_directory, directory_mod):
                self.patch(module, "fsync_dir", lambda o: failing(o, eio))
        elif kind in ("upload", "upload_lost"):
            self.patch(backend_mod.OBJECT_STORE, "upload",
                       lambda o: failing(o, storage, done=kind == "upload_lost"))
        elif kind == "retention":
            self.patch(step_removal, "remove_step", lambda o: failing(o, storage))
            self.patch(backend_mod.OBJECT_STORE, "remove_all", lambda o: failing(o, storage))
        else:
            raise AssertionError(kind)
        try:
            yield
        finally:
            self.undo()


def settle(writer, patience: float = 60.0) -> None:
    """`wait_durable`, bounded: a hang is a failure, not a stuck test run."""
    assert writer.wait_durable(timeout=patience), f"not durable within {patience} s: {writer.counters}"


def healed(writer) -> None:
    """Wait for a writer whose disk works again, whose error was raised: it is not raised again,
    the next wait tries at once and returns once everything is durable (docs/mirror.md)."""
    settle(writer)


def poll(check: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@contextlib.contextmanager
def writer_dies_after_its_next_job(pipeline: Callable[[], engine.Pipeline]) -> Iterator[None]:
    """The background writer of `pipeline()` raises, and so dies, once it completes its next
    job (what the block submits, or what is already queued); the block ends once it is dead."""
    original = engine.Pipeline._completed

    def dying(pipeline, job, generation):
        engine.Pipeline._completed = original
        raise RuntimeError("the writer thread was killed")
    engine.Pipeline._completed = dying
    try:
        yield
        poll(lambda: not pipeline()._thread.is_alive(), "the writer did not die")
    finally:
        engine.Pipeline._completed = original


# --- the manager -----------------------------------------------------------------------------------

def kept(view: dict[int, dict], policy: dict) -> set[int]:
    """The steps of `view` ({step: metrics}) the policy keeps, as the docs state it: the latest,
    the last N, the multiples of K, the best N by the metric (ties to the later step)."""
    if not view:
        return set()
    if not {"keep_last", "keep_every", "keep_best"} & set(policy):
        return set(view)
    ordered = sorted(view)
    keep = {ordered[-1]}
    if "keep_last" in policy:
        keep.update(ordered[-policy["keep_last"]:])
    if "keep_every" in policy:
        keep.update(s for s in ordered if s % policy["keep_every"] == 0)
    if "keep_best" in policy:
        sign = 1 if policy.get("best_mode", "min") == "min" else -1
        scored = sorted((sign * m["loss"], -s) for s, m in view.items() if "loss" in m)
        keep.update(-s for _, s in scored[:policy["keep_best"]])
    return keep


class ManagerMachine(RuleBasedStateMachine):
    """A `CheckpointManager` and a model of what it must hold."""

    #: Makes a new, empty directory (a local path or a bucket prefix) for each example.
    where: Callable[[], str]
    remote = False

    def __init__(self) -> None:
        super().__init__()
        self.directory = self.where()
        self.faults = Faults()
        self.mgr: jckpt.CheckpointManager | None = None
        self.saved: dict[int, Saved] = {}   # every step admitted and not known to be lost
        self.view: dict[int, dict] = {}     # the steps durable on storage, with their metrics
        self.pending: list[int] = []        # admitted, not yet known durable, in order
        self.committed = self.generation = 0
        self.last = 0                       # the last step admitted
        self.error: int | str = 0
        self.durable = 0                    # the counters' durable: the last snapshot durable
        self.dead = False                   # the writer thread was killed
        self.unlisted: dict[int, int] = {}  # steps a failed save left in place: their generation
        self.deleted: set[int] = set()      # steps this manager's retention deleted

    # opening and closing

    def open(self) -> None:
        for step, generation in sorted(self.unlisted.items()):  # found, no retention until a save
            self.view[step] = self.saved[step].metrics
            if step == max(self.view):
                self.generation = generation
        self.unlisted = {}
        self.mgr = jckpt.CheckpointManager(self.directory, retry_after=0.005, patience=2,
                                           slots=self.slots, directory_steps=self.dirs,
                                           **self.policy)
        self.committed = self.durable = 0
        self.error, self.dead, self.deleted = 0, False, set()
        self.last = max(self.view, default=0)  # a new process: steps admitted and lost are no bound

    @initialize(policy=st.sampled_from(POLICIES), slots=st.integers(1, 3),
                dirs=st.sampled_from([False, False, True]))
    def start(self, policy, slots, dirs):
        """Open the first manager: `dirs` writes each step as a directory checkpoint (what a
        multi-process run writes), synchronously."""
        self.policy, self.slots, self.dirs = policy, slots, dirs
        self.open()

    def teardown(self):
        self.faults.undo()
        RAW_POISON.clear()
        if self.mgr is not None:
            with contextlib.suppress(jckpt.CheckpointError):
                self.mgr.close(timeout=60)

    def published(self) -> None:
        """The model of every pending step becoming durable, in order, each followed by retention."""
        for step in self.pending:
            self.view[step] = self.saved[step].metrics
            self.generation += 1
            self.prune()
        if self.pending:
            self.durable, self.error = self.committed, 0
        self.pending = []

    #: How many of the doomed steps retention manages to delete (None: all), while its
    #: deletions fail: locally one by one, ascending; in a bucket all with their markers' DELETE.
    prune_limit: int | None = None

    def prune(self) -> None:
        doomed = sorted(set(self.view) - kept(self.view, self.policy))
        if self.prune_limit is not None:
            doomed = doomed[:self.prune_limit] if not self.remote else \
                (doomed if self.prune_limit else [])
        for step in doomed:
            del self.view[step]
            del self.saved[step]
            self.deleted.add(step)

    def settle(self) -> None:
        settle(self.mgr)
        self.published()

    # saving

    @rule(gap=st.integers(1, 3), seed=st.integers(0, 2**20), fmt=st.sampled_from(FORMATS),
          loss=st.sampled_from([0.5, 0.25, 0.125, 1.0, 2.0]), trainer=st.booleans(),
          items=st.booleans(), wait=st.booleans())
    def save(self, gap, seed, fmt, loss, trainer, items, wait):
        step = self.last + gap
        self.unlisted.pop(step, None)  # a step a failed save left is replaced
        tree = tree_for(seed)
        if self.dirs:  # jckpt only, one namespace
            fmt, items = "jckpt", False
        if fmt == "raw":
            tree = {"model": {"w": tree["model"]["w"]}, "opt": tree["opt"]}
        state = jckpt.TrainerState(global_step=step, consumed_batches=seed, user={"seed": seed}) \
            if trainer else None
        metadata = {"seed": str(seed)} if trainer else {}
        if items:
            args = {"items": tree}
        else:  # a plain tree: everything under the context's namespace is the model
            tree = {"jckpt": tree["model"]} if fmt != "jckpt" else {"jckpt": tree}
            args = {"tree": tree["jckpt"]}
        assert self.mgr.save(step, **args, metrics={"loss": loss}, trainer_state=state,
                             metadata=metadata, options=options_for(fmt))
        self.saved[step] = Saved(tree, fmt, {"loss": loss}, state, metadata)
        self.pending.append(step)
        self.committed += 1
        self.last = step
        if wait or self.dirs:
            self.settle()

    @rule()
    def wait(self):
        self.settle()

    @precondition(lambda self: self.last > 0)
    @rule(back=st.integers(0, 3))
    def save_refuses_a_step_not_above_the_last(self, back):
        with pytest.raises(jckpt.InputError, match="not above") as e:
            self.mgr.save(max(0, self.last - back), {"x": np.float32(0)}, force=True)
        check_error(e.value, self.directory)

    # reading

    def check_step(self, step: int, mgr: jckpt.CheckpointManager | None = None) -> None:
        want = self.saved[step]
        r = (mgr or self.mgr).restore(step, ctx=HOST, options=RAW_LOAD if want.fmt == "raw" else None)
        assert r.step == step
        assert_same(r.tree, want.tree, f"step {step} ({want.fmt})")
        assert r.metrics == want.metrics
        assert r.trainer_state == want.trainer, (r.trainer_state, want.trainer)
        assert r.metadata == want.metadata

    @precondition(lambda self: not self.pending)
    @rule()
    def restore_latest(self):
        if not self.view:
            with pytest.raises(jckpt.FormatError, match="no checkpoint") as e:
                self.mgr.restore()
            check_error(e.value, self.directory)
            return
        latest = max(self.view)
        want = self.saved[latest]
        r = self.mgr.restore(ctx=HOST, options=RAW_LOAD if want.fmt == "raw" else None)
        assert r.step == latest
        assert_same(r.tree, want.tree, f"latest step {latest}")

    @precondition(lambda self: not self.pending)
    @rule(data=st.data())
    def restore_a_step(self, data):
        if not self.view:
            return
        self.check_step(data.draw(st.sampled_from(sorted(self.view))))

    @rule(data=st.data())
    def restore_a_step_that_is_not_there(self, data):
        gone = data.draw(st.sampled_from([s for s in range(self.last + 4) if s not in self.saved]))
        said = f"no step {gone}: retention deleted it" if gone in self.deleted else \
            f"no step {gone}|{step_name(gone)}: holds neither"  # what a killed save left, in a bucket
        with pytest.raises(jckpt.FormatError, match=said) as e:
            self.mgr.restore(gone)
        check_error(e.value, self.directory)

    @rule()
    def restore_while_saving(self):
        """A restore of the latest step races retention of a step in flight: it may find the
        step removed (an error naming it), never a damaged one."""
        latest = self.mgr.latest_step()
        if latest is None:
            return
        want = self.saved[latest]
        try:
            r = self.mgr.restore(latest, ctx=HOST, options=RAW_LOAD if want.fmt == "raw" else None)
        except jckpt.FormatError as e:
            assert self.pending, e
            check_error(e, step_name(latest))
            return
        assert_same(r.tree, want.tree, f"step {latest} restored while saving")

    # reopening

    @rule()
    def reopen(self):
        """Close and open again on the same directory, as a new process would."""
        self.mgr.close()
        self.published()
        self.open()
        self.check_nothing_else()
        for step in sorted(self.view):  # no step lost or damaged by what happened since it was saved
            self.check_step(step)

    def check_nothing_else(self) -> None:
        """A manager that opened leaves the steps it lists and nothing else of a step's name."""
        found = sorted(n for n in self.names() if "step_" in n)
        assert found == [step_name(s) for s in sorted(self.view)], found

    # faults

    def fails(self, writer, name: str) -> bool:
        """Wait for what a fault makes fail: False when the writes were done before the fault
        began (`after` calls let through); True once `wait_durable` raised the error, which
        must name the step."""
        try:
            assert writer.wait_durable(timeout=60), "neither durable nor failed within 60 s"
        except jckpt.StorageError as e:
            check_error(e, name)
            assert writer.counters.error != 0
            return True
        return False

    @staticmethod
    def still_failing(writer, name: str) -> None:
        """A wait after the error was raised, the storage still failing: one more attempt,
        whose own failure it raises (neither the same error again nor a hang)."""
        failures = writer.counters.failures
        with pytest.raises(jckpt.StorageError) as e:
            writer.wait_durable(timeout=60)
        check_error(e.value, name)
        assert writer.counters.failures > failures and writer.counters.error != 0

    @precondition(lambda self: not self.dead)
    @rule(data=st.data(), after=st.integers(0, 2), heal=st.booleans(), seed=st.integers(0, 2**20),
          once=st.booleans(), more=st.booleans())
    def storage_fails(self, data, after, heal, seed, once, more):
        """A step whose write or publish fails: the steps before it stay listed and intact, and
        one more save waits for a slot (none free: it raises the error); healed (or failing
        `once`), it is written; else `close` raises and the step is not there (unless its rename
        went through before the failure)."""
        kind = data.draw(st.sampled_from(["disk_full", "upload", "upload_lost"] if self.remote else
                                         ["disk_full", "fsync_file", "fsync_dir"]))
        self.settle()
        if self.dirs:
            return self.directory_save_fails(kind, after, seed)
        self.save(1, seed, "jckpt" if seed % 2 else "npz", 0.75, True, True, False)
        step = self.last
        with self.faults.on(kind, after=after, once=once):
            if once or not self.fails(self.mgr, step_name(step)):
                self.settle()  # one failed attempt is retried at once, patience is 2
                return
            self.check_listed(kind)
            self.still_failing(self.mgr, step_name(step))
            if more:
                self.save_while_failing(step, seed)
            if not heal:
                with pytest.raises(jckpt.StorageError) as e:
                    self.mgr.close()
                check_error(e.value, step_name(step))
        if heal:
            healed(self.mgr)
            self.published()
            return
        self.open()
        lost = [s for s in self.pending if s not in self.mgr.all_steps()]
        assert lost == self.pending[len(self.pending) - len(lost):], (lost, self.pending)
        if len(lost) < len(self.pending):  # its rename (or upload) went through before the failure
            assert kind in ("fsync_dir", "upload_lost"), kind
            self.view[step] = self.saved[step].metrics  # no retention until the next save
            self.generation += 1
        for s in lost:
            del self.saved[s]
        self.pending = []
        self.last = max(self.view, default=0)

    def directory_save_fails(self, kind: str, after: int, seed: int) -> None:
        """A directory step's save is synchronous: a failure raises from `save`, names the step
        and leaves the steps before it; the step may be saved again. One that failed after its
        rename (the directory's fsync) is in place, complete, and listed when a manager opens."""
        step = self.last + 1
        saved = Saved({"jckpt": tree_for(seed)}, "jckpt", {"loss": 0.75}, None, {})
        with self.faults.on(kind, after=after):
            try:
                self.mgr.save(step, tree_for(seed), metrics={"loss": 0.75})
            except jckpt.StorageError as e:
                check_error(e, step_name(step))
                self.error = ERRNO[kind]  # it stands, as a failed file step's does, until a save
                self.check_listed(kind)
                self.left_in_place(step, saved, kind)
                return
        self.unlisted.pop(step, None)
        self.saved[step] = saved
        self.pending.append(step)
        self.committed += 1
        self.last = step
        self.published()

    def left_in_place(self, step: int, saved: Saved, kind: str) -> None:
        """What a failed directory save of `step` left: nothing, the step a failed save left
        there before (intact), or this one, complete (its rename went through)."""
        path = f"{self.directory}/{step_name(step)}"
        if not backend_mod.backend_for(path).exists(f"{path}/index.jckpt"):
            assert step not in self.unlisted, step
            return
        got = jckpt.load(HOST, path, verify=True)[1]
        if kind == "fsync_dir" and flat(got).keys() == flat(saved.tree).keys() and all(
                flat(got)[k].tobytes() == v.tobytes() for k, v in flat(saved.tree).items()):
            self.saved[step], self.unlisted[step] = saved, self.generation + 1
            return
        assert step in self.unlisted, (step, kind)
        assert_same(got, self.saved[step].tree, f"step {step} left by a failed save")

    def save_while_failing(self, step: int, seed: int) -> None:
        """A save while the writer has given up on `step`: with a free slot it is admitted; with
        none, it raises the writer's error (rather than wait for a slot that will not free)."""
        if self.slots > 1:
            return self.save(1, seed + 1, "jckpt", 0.5, False, True, False)
        with pytest.raises(jckpt.StorageError) as e:
            self.mgr.save(self.last + 1, tree_for(seed)["opt"])
        check_error(e.value, step_name(step))

    @rule()
    def a_second_writer_is_refused(self):
        with pytest.raises(jckpt.InUseError) as e:
            jckpt.CheckpointManager(self.directory)
        check_error(e.value, self.directory.rstrip("/"))

    @precondition(lambda self: not self.pending)
    @rule()
    def a_reader_lists_and_restores_what_the_writer_does(self):
        """A read-only manager beside the writer lists what a writer opening now would (its
        steps, and those a failed save left in place; not what killed writers left), reads
        them as saved, and creates, renames and removes nothing."""
        before = sorted(self.names())
        with jckpt.CheckpointManager(self.directory, read_only=True) as reader:
            listed = reader.all_steps()
            assert listed == sorted(set(self.view) | set(self.unlisted)), (listed, self.view)
            if listed:
                self.check_step(listed[-1], reader)
            assert reader.reload() == listed
        assert sorted(self.names()) == before

    @rule(seed=st.integers(0, 2**20), fmt=st.sampled_from(FORMATS), after=st.integers(0, 1))
    def retention_fails(self, seed, fmt, after):
        """Retention's deletions fail (from the `after`-th on): the step stands, the steps not
        deleted stay listed and restorable, and the next save's retention deletes them; what a
        failure leaves of a step it did delete is removed when a manager opens."""
        self.settle()
        self.save(1, seed, fmt, 0.3, False, True, False)
        with self.faults.on("retention", after=after):
            self.prune_limit = after
            try:
                self.settle()
            finally:
                self.prune_limit = None
        self.check_listed("retention failed")

    @precondition(lambda self: not self.dead and not self.dirs)
    @rule(seed=st.integers(0, 2**20), more=st.integers(0, 2))
    def writer_thread_dies(self, seed, more):
        """The background writer dies right after publishing a step: the step is published, the
        saves after it are refused at once (they would never be written, and once the slots
        ran out a save waited forever), and a reopened manager has it."""
        self.settle()
        self.save(1, seed, "jckpt", 0.4, False, True, False)
        with writer_dies_after_its_next_job(lambda: self.mgr._pipeline):
            pass
        self.dead = True
        self.published()  # the step was renamed into place and recorded before the thread died
        for _ in range(more):  # refused at once: admitted, it would never be written
            with pytest.raises(jckpt.CheckpointError, match="writer stopped") as e:
                self.mgr.save(self.last + 1, tree_for(seed)["opt"])
            check_error(e.value, self.directory)
        assert self.mgr.counters.error == "RuntimeError"
        with pytest.raises(jckpt.CheckpointError) as e:
            self.mgr.wait_durable(timeout=30)
        check_error(e.value, self.directory)
        with pytest.raises(jckpt.CheckpointError) as e:
            self.mgr.close()
        check_error(e.value, self.directory)
        self.open()

    @precondition(lambda self: not self.dirs)
    @rule(seed=st.integers(0, 2**20))
    def model_writer_raises(self, seed):
        """A model writer callback that raises drops its step: the steps after it are written,
        the next wait raises its error once, naming the step."""
        self.settle()
        RAW_POISON.set()
        try:
            self.save(1, seed, "raw", 0.6, False, True, False)
            dropped = self.pending.pop()
            with pytest.raises(jckpt.CheckpointError) as e:
                settle(self.mgr)
            check_error(e.value, step_name(dropped))
        finally:
            RAW_POISON.clear()
        del self.saved[dropped]
        c = self.mgr.counters  # the storage did not fail: no error stands, the drop is counted
        assert str(c).endswith(f"error {self.error}") and "told to fail" in c.last_error, str(c)
        settle(self.mgr)  # raised once

    @rule(where=st.sampled_from(["above", "between"]), data=st.data())
    def killed_writer_leftovers(self, where, data):
        """What a killed writer leaves (a staged step file and step directory, a save's staging
        file, a step directory without its record) is removed when a manager opens, and hides
        no step."""
        self.mgr.close()
        self.published()
        gaps = [s for s in range(1, self.last + 1) if s not in self.saved]
        above = max([self.last, *self.saved]) + 1
        step = above if where == "above" or not gaps else data.draw(st.sampled_from(gaps))
        staged_here = self.plant(step, data.draw(st.integers(1, 9)))
        self.open()
        self.check_listed("after a killed writer's leftovers")
        self.check_nothing_else()
        assert not [p for p in staged_here if os.path.exists(p)], staged_here

    def plant(self, step: int, seq: int) -> list[str]:
        """Plant what a writer of `step` killed mid-save leaves; the local files outside the
        directory it left (a bucket's steps are staged in the temporary directory)."""
        name = step_name(step)
        if self.remote:
            import obstore

            from jckpt.storage.object_store import ObjectURL, store_for
            u = ObjectURL.parse(f"{self.directory}/{name}/model.npz")
            obstore.put(store_for(u), u.key, b"PK\x03\x04 half a model")
            staged_here = staging.next_name(f"{self.directory}/{name}", seq)
            with open(staged_here, "wb") as f:  # a step staged locally, never uploaded
                f.write(b"half a step")
            return [staged_here]
        d = self.directory
        with open(os.path.join(d, f"{name}{NEXT_TAG}{seq}"), "wb") as f:
            f.write(b"jckpt half a generation")
        os.makedirs(os.path.join(d, f"{name}{NEXT_TAG}{seq + 1}"))
        with open(os.path.join(d, f"{name}{NEXT_TAG}{seq + 1}", "model.npz"), "wb") as f:
            f.write(b"PK\x03\x04 half a model")
        with open(os.path.join(d, f"{name}{STAGE_TAG}000f423f.{seq:08x}.{uuid.uuid4().hex[:16]}"), "wb") as f:
            f.write(b"a save's staging file")
        stage = os.path.join(d, f"{name}{STAGE_DIR_TAG}{uuid.uuid4().hex[:16]}")
        os.makedirs(stage)  # a directory checkpoint's, whose lock went with its writer
        with open(os.path.join(stage, "process_00000.jckpt"), "wb") as f:
            f.write(b"half a piece")
        if step not in self.view:
            os.makedirs(os.path.join(d, name))
            with open(os.path.join(d, name, "optimizer.jckpt"), "wb") as f:
                f.write(b"half an optimizer")
        return []

    # the invariants

    def names(self) -> list[str]:
        return backend_mod.backend_for(self.directory).list(self.directory)

    def check_listed(self, what: str) -> None:
        listed = self.mgr.all_steps()
        assert listed == sorted(self.view), (what, listed, sorted(self.view))
        if listed:
            self.check_step(listed[-1])

    @invariant()
    def steps_listed_are_the_models(self):
        STATS[type(self).__name__] += 1
        if self.mgr is None:
            return
        listed = self.mgr.all_steps()
        if self.pending:  # in flight: each listed step is one saved, none older than the model's
            assert set(listed) <= set(self.saved), (listed, sorted(self.saved))
            if self.view:
                assert max(listed) >= max(self.view), (listed, self.view)
            return
        assert listed == sorted(self.view), (listed, sorted(self.view))
        assert self.mgr.latest_step() == (max(self.view) if self.view else None)
        for mode, sign in (("min", 1), ("max", -1)):  # ties go to the later step
            best = min(self.view, key=lambda s: (sign * self.view[s]["loss"], -s), default=None)
            assert self.mgr.best_step("loss", mode) == best, (mode, self.view)
        for step, metrics in self.view.items():
            assert self.mgr.metrics(step) == metrics

    @invariant()
    def counters_match_the_model(self):
        if self.mgr is None or self.dead:
            return
        c = self.mgr.counters
        assert c.committed == self.committed, (str(c), self.committed)
        if not self.pending:
            want = (f"memory mirror: committed {self.committed} durable {self.durable} "
                    f"generation {self.generation} pending 0 error {self.error}")
            assert str(c) == want, (str(c), want)

    @invariant()
    def newest_durable_step_restores_bit_for_bit(self):
        if self.mgr is None or self.pending or not self.view:
            return
        self.check_step(max(self.view))


# --- the mirror ------------------------------------------------------------------------------------

class MirrorMachine(RuleBasedStateMachine):
    """A `Mirror` and a model of its file and counters."""

    where: Callable[[], str]
    remote = False

    def __init__(self) -> None:
        super().__init__()
        self.path = self.where() + "/run.jckpt"
        self.faults = Faults()
        self.mirror: jckpt.Mirror | None = None
        self.last: dict | None = None       # the tree durable in the file
        self.staged: dict | None = None     # the last tree submitted
        self.meta = self.last_meta = {}     # the user metadata submitted with it, and in the file
        self.committed = self.generation = self.queued = 0

    def open(self) -> None:
        self.mirror = jckpt.Mirror(self.path, retry_after=0.005, patience=2)
        self.committed = self.queued = 0

    @initialize()
    def start(self):
        self.open()

    def teardown(self):
        self.faults.undo()
        if self.mirror is not None:
            with contextlib.suppress(jckpt.CheckpointError):
                self.mirror.close(timeout=60)

    @rule(seed=st.integers(0, 5), same=st.booleans(), wait=st.booleans(),
          note=st.sampled_from(["", "a", "b"]))
    def submit(self, seed, same, wait, note=""):
        tree = self.staged if same and self.staged is not None else tree_for(seed)
        meta = {"note": note} if note else {}
        if self.staged is None or meta != self.meta or flat(tree).keys() != flat(self.staged).keys() \
                or any(flat(tree)[k].tobytes() != flat(self.staged)[k].tobytes() for k in flat(tree)):
            self.generation += 1  # a snapshot equal to the last (metadata too) makes no generation
        self.staged, self.meta = tree, meta
        assert self.mirror.submit(tree, metadata=meta) == self.committed + 1
        self.committed += 1
        self.queued += 1
        if wait:
            self.flush()

    @rule()
    def flush(self):
        settle(self.mirror)
        self.flush_model()

    @rule()
    def reopen(self):
        self.mirror.close()
        self.flush_model()
        self.open()

    def flush_model(self):
        self.queued = 0
        self.last, self.last_meta = self.staged, self.meta

    def generation_found(self) -> int | None:
        try:
            return int(jckpt.describe(self.path).metadata_dict()["jckpt.generation"])
        except jckpt.FormatError:
            return None

    @rule(data=st.data(), heal=st.booleans())
    def storage_fails(self, data, heal):
        """A generation whose write or publish fails: the previous one stays in the file,
        intact; healed, it is written; else `close` raises and the file keeps the previous one
        (unless its rename went through before the failure)."""
        kind = data.draw(st.sampled_from(["disk_full", "upload", "upload_lost"] if self.remote else
                                         ["disk_full", "fsync_file", "fsync_dir"]))
        self.flush()
        with self.faults.on(kind):
            self.submit(10**6 + self.generation, False, False)  # unlike any tree written before
            with pytest.raises(jckpt.StorageError) as e:
                assert self.mirror.wait_durable(timeout=60)
            check_error(e.value, self.path)
            ManagerMachine.still_failing(self.mirror, self.path)
            if kind in ("fsync_dir", "upload_lost") and self.generation_found() == self.generation:
                self.check_file(self.generation, self.staged, self.meta)  # published, then failed
            else:
                self.check_file(self.generation - 1)  # the previous generation, intact
            if not heal:
                with pytest.raises(jckpt.StorageError) as e:
                    self.mirror.close()
                check_error(e.value, self.path)
        if heal:
            healed(self.mirror)
            self.flush()
            return
        self.open()
        if self.generation_found() == self.generation:  # renamed before the failure
            assert kind in ("fsync_dir", "upload_lost"), kind
            self.flush_model()
        else:
            self.generation -= 1
            self.staged, self.meta = self.last, self.last_meta

    @rule(seed=st.integers(0, 5))
    def writer_thread_dies(self, seed):
        """The writer dies after publishing a generation: submit, wait and close raise an error
        saying so (never a hang), and the mirror opened again continues from that generation."""
        self.flush()
        with writer_dies_after_its_next_job(lambda: self.mirror._pipeline):
            self.submit(10**6 + self.generation, False, False)
        self.flush_model()  # published before the thread died
        for call in (lambda: self.mirror.submit(tree_for(seed)), self.mirror.wait_durable,
                     self.mirror.close):
            with pytest.raises(jckpt.CheckpointError, match="writer stopped") as e:
                call()
            check_error(e.value, self.path)
        self.open()

    @rule(seq=st.integers(1, 9))
    def killed_writer_leftovers(self, seq):
        self.mirror.close()
        self.flush_model()
        temporary = staging.next_name(self.path, seq)
        with open(temporary, "wb") as f:
            f.write(b"jckpt half a generation")
        self.open()
        assert not os.path.exists(temporary)

    def check_file(self, generation: int, tree: dict | None = None, meta: dict | None = None) -> None:
        tree = tree if tree is not None else self.last
        meta = meta if meta is not None else self.last_meta
        if tree is None:
            assert self.generation_found() is None
            return
        got = jckpt.load(HOST, self.path, verify=True)[1]
        assert_same(got, {"jckpt": tree}, "the mirror's file")
        assert self.generation_found() == generation
        found = jckpt.describe(self.path).metadata_dict()
        assert {k: v for k, v in found.items() if not k.startswith("jckpt.")} == meta, found

    @invariant()
    def counters_and_file_match_the_model(self):
        STATS[type(self).__name__] += 1
        if self.mirror is None:
            return
        c = self.mirror.counters
        assert c.committed == self.committed
        if not self.queued:
            assert str(c) == (f"memory mirror: committed {self.committed} durable {self.committed} "
                              f"generation {self.generation} pending 0 error 0"), str(c)
            self.check_file(self.generation)


# --- the runs --------------------------------------------------------------------------------------

def run(machine: type, where: Callable[[], str], *, examples: int, steps: int, remote=False) -> None:
    machine = type(machine.__name__, (machine,), {"where": staticmethod(where), "remote": remote})
    STATS.clear()
    run_state_machine_as_test(machine, settings=state_settings(examples, steps))
    print(f"{machine.__name__}: {examples * STATES_SCALE} examples, {sum(STATS.values())} checks")


@pytest.mark.slow
def test_manager_states(tmp_path):
    run(ManagerMachine, lambda: tempfile.mkdtemp(dir=tmp_path), examples=60, steps=25)


@pytest.mark.slow
def test_mirror_states(tmp_path):
    run(MirrorMachine, lambda: tempfile.mkdtemp(dir=tmp_path), examples=40, steps=20)


@pytest.mark.slow
def test_manager_states_in_a_bucket(s3):
    run(ManagerMachine, lambda: f"{s3}/run-{uuid.uuid4().hex[:8]}", examples=12, steps=20,
        remote=True)


@pytest.mark.slow
def test_mirror_states_in_a_bucket(s3):
    run(MirrorMachine, lambda: f"{s3}/m-{uuid.uuid4().hex[:8]}", examples=12, steps=15, remote=True)
