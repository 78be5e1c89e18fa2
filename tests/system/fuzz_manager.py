"""Structure-aware fuzzing of a manager directory: its steps, their records and trainer states.

``tests/system/fuzz_formats.py`` fuzzes each file format by its fields; a manager
directory is more than its files: step names and kinds (a file, a step directory),
each step's metadata (``jckpt.step``, ``jckpt.metrics``, ``jckpt.trainer_state``,
the lineage) in a native header or in a step directory's record
(``trainer_state.json``), the members a record names, the writer lease and the
leftovers of interrupted saves. Each case copies a small valid directory (a file
step and a step directory with a safetensors model, both with metrics and a
``TrainerState``), changes zero to three of those parts to values chosen to hurt,
and opens it as users do: a read-only manager (every step listed, its metrics,
restored with its trainer state, the best step), ``jckpt.info``, ``jckpt.verify``,
``jckpt inspect`` and ``jckpt verify``, and a writer manager opened and closed.
The ``trainer_state`` format fuzzes ``TrainerState.from_json`` alone.

Oracles, beyond fuzz_formats' (only a ``CheckpointError`` naming the directory, in
bounded time and memory):

* a case with no mutation lists steps 1 and 2 and restores their arrays and trainer state;
* ``verify`` and the command line never raise (exit 0, 1 or 2, no "unexpected" error);
* opening a writer manager removes or changes no step the reader restored.

By hand, for longer::

    MALLOC_ARENA_MAX=2 python -m tests.system.fuzz_manager --cases 20000 --seed 7
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from typing import Any

import numpy as np

from tests.helpers import cli_in_process
from tests.system import fuzz_formats
from tests.system.fuzz_formats import (
    INTS,
    JSONS,
    NAMES,
    Case,
    Disallowed,
    _deep_json,
    _mutations,
    _put,
    _signature,
    leaves,
)

ARRAYS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "m": np.arange(4, dtype=np.int64)}
STATE = {"global_step": 2, "consumed_batches": 7, "learning_rate": 0.5, "best_loss": 1.25,
         "dp": 1, "tp": 1, "pp": 1, "user": {"epoch": 1}}
STATE_FIELDS = [*STATE, "_extra"]
STATE_VALUES: list[Any] = [*JSONS, *INTS, float("nan"), "inf", "-inf", "NaN", {"a": [1] * 3}, 0.0]
RECORD_FIELDS = ["step", "metrics", "model", "model_format", "model_namespace", "optimizer",
                 "metadata", "trainer_state", "extra"]
META_KEYS = ["jckpt.step", "jckpt.metrics", "jckpt.trainer_state", "jckpt.lineage",
             "jckpt.generation", "jckpt.save", "jckpt.empty_nodes"]
_TEMPLATE: dict[str, str] = {}


def _template(workdir: str) -> str:
    """The valid directory every case starts from, made once per process by a manager."""
    if "path" not in _TEMPLATE:
        import jckpt
        from jckpt.services.formats import CheckpointOptions

        path = os.path.join(workdir, "template")
        state = jckpt.TrainerState(**STATE)
        with jckpt.CheckpointManager(path, asynchronous=False) as mgr:
            mgr.save(1, {"w": ARRAYS["w"]}, metrics={"loss": 1.5}, trainer_state=state)
        with jckpt.CheckpointManager(path, asynchronous=False,
                                     options=CheckpointOptions(format="safetensors")) as mgr:
            mgr.save(2, items={"model": {"w": ARRAYS["w"]}, "opt": {"m": ARRAYS["m"]}},
                     metrics={"loss": 0.5}, trainer_state=state)
        _TEMPLATE["path"] = path
    return _TEMPLATE["path"]


def _hostile_json(rng: random.Random) -> Any:
    return rng.choice([*STATE_VALUES, *NAMES, [STATE] * 2, {"loss": "x"}, {"loss": [1]},
                       {"": 1.0, "loss": 1e308}, {str(i): i for i in range(rng.choice([3, 5000]))}])


def _json_text(rng: random.Random, value: Any) -> str:
    """`value` as JSON, or text no JSON reader takes as the object it wants."""
    return rng.choice([json.dumps(value), json.dumps(value), _deep_json(rng), "", "{", "[]",
                       "NaN", "1e999", '{"a": 1, "a": 2}', "\udcff", json.dumps(value) * 2])


def _mutated_state(rng: random.Random) -> dict[str, Any]:
    state = json.loads(json.dumps(STATE))
    for _ in range(rng.randrange(1, 3)):
        field = rng.choice(STATE_FIELDS)
        if rng.random() < 0.2:
            state.pop(field, None)
        else:
            state[field] = _hostile_json(rng)
    return state


def _record(path: str) -> Any:
    try:
        return json.load(open(path))
    except RecursionError:  # a mutation before this one nested it deep
        raise ValueError("nested too deep") from None


def _rewrite_file_step(path: str, metadata: dict[str, str]) -> None:
    from tests.helpers import write_arrays

    os.remove(path)
    write_arrays(path, {"w": ARRAYS["w"]}, metadata=metadata)


def make_manager(rng: random.Random, path: str) -> Case:
    """A manager directory (steps 1, a file, and 2, a step directory) with parts mutated."""
    shutil.copytree(_template(os.path.dirname(os.path.dirname(path))), path, symlinks=True)
    file_step = os.path.join(path, "step_00000001.jckpt")
    folder = os.path.join(path, "step_00000002.jckpt")
    record_path = os.path.join(folder, "trainer_state.json")

    def record_fields():
        record = _record(record_path)
        for _ in range(rng.randrange(1, 3)):
            field = rng.choice(RECORD_FIELDS)
            if rng.random() < 0.2:
                record.pop(field, None)
            elif field == "trainer_state":
                record[field] = _mutated_state(rng)
            elif field == "metadata":
                record[field] = {rng.choice(META_KEYS): rng.choice([*NAMES, "2", "-1", str(2**70)])}
            else:
                record[field] = rng.choice([*JSONS, *NAMES, *INTS, "model.npz", "../outside",
                                            "optimizer.jckpt", "trainer_state.json"])
        _put(record_path, json.dumps(record).encode())

    def record_text():
        _put(record_path, _json_text(rng, _record(record_path)).encode("utf-8", "surrogatepass"))

    def file_metadata():
        from jckpt.errors import CheckpointError
        from jckpt.storage.checkpoint import open_checkpoint

        try:
            meta = open_checkpoint(file_step).header.metadata_dict()
        except CheckpointError as e:  # a mutation before this one made it no step file
            raise ValueError(e) from None
        for _ in range(rng.randrange(1, 3)):
            key = rng.choice(META_KEYS)
            if rng.random() < 0.2:
                meta.pop(key, None)
            elif key == "jckpt.trainer_state":
                meta[key] = _json_text(rng, _mutated_state(rng))
            elif key == "jckpt.metrics":
                meta[key] = _json_text(rng, _hostile_json(rng))
            else:
                meta[key] = rng.choice([*NAMES, "2", "-1", "1.5", str(2**70), "\u0661", _deep_json(rng)])
        _rewrite_file_step(file_step, {k: v.encode("utf-8", "replace").decode() for k, v in meta.items()})

    def step_names():
        old = rng.choice([file_step, folder])
        new = rng.choice(["step_000000001.jckpt", "step_99999999999999999999999.jckpt",
                          "step_0000001.jckpt", "step_00000002.jckpt",
                          "step_" + "\u0661" * 8 + ".jckpt",
                          "step_00000003.jckpt.jckpt-stage.1.2.x", "step_00000000.jckpt"])
        new = os.path.join(path, new)
        if os.path.exists(new):
            shutil.rmtree(new) if os.path.isdir(new) else os.remove(new)
        os.rename(old, new)

    def step_kinds():
        what = rng.randrange(6)
        victim = rng.choice([file_step, folder])
        if what < 3:
            shutil.rmtree(victim) if os.path.isdir(victim) else os.remove(victim)
        if what == 0:
            os.mkdir(victim)
        elif what == 1:
            _put(victim, rng.choice([b"", b"\0" * 64, b"{}"]))
        elif what == 2:
            os.symlink(rng.choice([victim, path, "/nonexistent", "step_00000002.jckpt"]), victim)
        elif what == 3:
            _put(os.path.join(path, "step_00000005.jckpt"), b"\0\0\0\x10((version 1) ())")
        elif what == 4:
            os.mkdir(os.path.join(path, "step_00000006.jckpt"))
            _put(os.path.join(path, "step_00000006.jckpt", rng.choice(
                ["process_00000.jckpt", "index.jckpt", "model.npz", "notes.txt"])), b"junk")
        else:
            os.symlink("step_00000001.jckpt", os.path.join(path, "step_00000004.jckpt"))

    def members():
        member = os.path.join(folder, rng.choice(["model.safetensors", "optimizer.jckpt",
                                                  "trainer_state.json", "model.npz"]))
        what = rng.randrange(4)
        if os.path.exists(member) and what < 3:
            os.remove(member)
        if what == 1:
            os.mkdir(member)
        elif what == 2:
            os.symlink(rng.choice([file_step, "/nonexistent", member]), member)
        elif what == 3 and os.path.isfile(member):
            data = bytearray(open(member, "rb").read())
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            _put(member, bytes(data))

    def leases():
        lease = os.path.join(path, rng.choice([".jckpt-lease", ".process00000.jckpt-lease",
                                               ".process00001.jckpt-lease",
                                               "step_00000001.jckpt.jckpt-lease"]))
        what = rng.randrange(4)
        if what == 0:
            _put(lease, rng.choice([b"", b"12345\n", b"x" * 100000, b"\xff\0"]))
        elif what == 1:
            os.mkdir(lease)
        elif what == 2:
            os.symlink(rng.choice(["/nonexistent", file_step, lease]), lease)
        else:
            os.mkfifo(lease)

    def leftovers():
        name = rng.choice(["step_00000003.jckpt.jckpt-stage.1.2.abc",
                           "step_00000002.jckpt.jckpt-stage-dir.1.2.abc",
                           "step_00000002.jckpt.jckpt-old.abc", "step_00000001.jckpt.jckpt-next.3",
                           "step_00000002.jckpt.jckpt-upload.abc"])
        target = os.path.join(path, name)
        if rng.random() < 0.5:
            shutil.copytree(folder, target) if os.path.isdir(folder) else os.mkdir(target)
        else:
            _put(target, rng.choice([b"", b"junk", open(file_step, "rb").read()
                                     if os.path.isfile(file_step) else b"x"]))

    bucket = rng.random() < 0.3  # read from an object store too
    done = _mutations(rng, {"record_fields": record_fields, "record_text": record_text,
                            "file_metadata": file_metadata, "step_names": step_names,
                            "step_kinds": step_kinds, "members": members, "leases": leases,
                            "leftovers": leftovers})
    # A mutator that raised (it did not apply) may have changed the directory before it did.
    same = _tree_bytes(path) == _tree_bytes(_template(os.path.dirname(os.path.dirname(path))))
    expected = _signature([ARRAYS["w"], ARRAYS["w"], ARRAYS["m"]]) if same else None
    return Case("manager", expected, (done or ([] if same else ["partial"])) + ["bucket"] * bucket)


def _tree_bytes(path: str) -> dict[str, bytes]:
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if os.path.islink(full):
                out[rel] = b"link:" + os.readlink(full).encode()
            elif os.path.isfile(full):
                out[rel] = open(full, "rb").read()
            else:
                out[rel] = b"other"
    return out


def make_trainer_state(rng: random.Random, path: str) -> Case:
    """A `TrainerState` JSON (a step's record field, or header metadata) with fields mutated."""
    state = _mutated_state(rng) if rng.random() < 0.9 else dict(STATE)
    text = _json_text(rng, state) if rng.random() < 0.3 else json.dumps(state)
    _put(path, text.encode("utf-8", "surrogatepass"))
    return Case("trainer_state", None, ["fields"] if state != STATE else [])


# --- reading a case --------------------------------------------------------------------

def _cli(*args: str) -> None:
    rc, err = cli_in_process(*args)
    if "unexpected" in err or "Traceback" in err or rc not in (0, 1, 2):
        raise Disallowed(f"jckpt {' '.join(args)}: exit {rc}: {err[-600:]}")


def _files(path: str, step: str) -> dict[str, bytes] | None:
    """The bytes of every file of a step (None where it is not there)."""
    where = os.path.join(path, step)
    if os.path.islink(where):
        return {"": os.readlink(where).encode()}
    if os.path.isfile(where):
        return {"": open(where, "rb").read()}
    if os.path.isdir(where):
        return {n: open(os.path.join(where, n), "rb").read() for n in sorted(os.listdir(where))
                if os.path.isfile(os.path.join(where, n))}
    return None


def _read_steps(path: str) -> tuple[list, dict[int, list]]:
    """A read-only manager's view: every step restored; the restored ones' leaves by step."""
    import jckpt
    from jckpt.format.names import step_name

    restored = {}
    with jckpt.CheckpointManager(path, ctx=jckpt.Context(host=True), read_only=True) as mgr:
        steps = mgr.all_steps()
        mgr.best_step("loss")
        for step in steps:
            mgr.metrics(step)
            r = mgr.restore(step)
            arrays = [np.asarray(x) for x in leaves(r.tree)]
            for a in arrays:
                np.ascontiguousarray(a).tobytes()
            if r.trainer_state is not None:
                r.trainer_state.to_json()
            restored[step] = (arrays, r.trainer_state, _files(path, step_name(step)))
        if steps:  # the stored trainer state adapted to another layout
            mgr.restore(steps[-1], layout=(2, 1, 1), reshard=True)
    return steps, restored


def check_manager(case: Case, path: str) -> str:
    """Read the case as users do; the outcome (``loaded`` or ``refused:<error type>``)."""
    import jckpt
    from jckpt.errors import CheckpointError
    from jckpt.format.names import step_name

    if case.format == "trainer_state":
        return _check_trainer_state(path)
    restored: dict = {}
    try:
        steps, restored = _read_steps(path)
        outcome = "loaded"
    except CheckpointError as e:
        if path not in str(e):
            raise Disallowed(f"error does not name the directory: {e}") from None
        outcome = "refused:" + type(e).__name__
    if case.expected is not None:
        if outcome != "loaded" or steps != [1, 2]:
            raise Disallowed(f"an unmutated directory read as {outcome}, steps {restored.keys()}")
        arrays = [a for s in (1, 2) for a in restored[s][0]]
        if _signature(arrays) != case.expected or restored[2][1] != jckpt.TrainerState(**STATE):
            raise Disallowed("an unmutated directory did not restore what it was saved with")
    try:
        jckpt.info(path).render()
    except CheckpointError as e:  # no steps left to show
        if path not in str(e):
            raise Disallowed(f"info's error does not name the directory: {e}") from None
    jckpt.verify(path)
    _cli("inspect", path)
    _cli("verify", path)
    _cli("diff", os.path.join(path, "step_00000001.jckpt"), os.path.join(path, "step_00000002.jckpt"))
    if case.format == "manager" and "bucket" in case.mutations:
        _check_bucket(path)
    try:
        with jckpt.CheckpointManager(path, ctx=jckpt.Context(host=True), asynchronous=False):
            pass
    except CheckpointError as e:
        if path not in str(e):
            raise Disallowed(f"a writer's error does not name the directory: {e}") from None
    for step, (_arrays, _state, files) in restored.items():
        if _files(path, step_name(step)) != files:
            raise Disallowed(f"opening a writer changed or removed step {step}, which read")
    return outcome


def _check_bucket(path: str) -> None:
    """The case's regular files put into an in-memory object store and read from there as
    from a bucket: its steps' markers (a record, an index) are objects, not files."""
    import jckpt
    from jckpt.errors import CheckpointError
    from jckpt.storage import object_store
    from jckpt.storage.object_store import ObjectURL, store_for

    _BUCKETS[0] += 1
    url = f"memory://fuzz{_BUCKETS[0]}/run"
    store = store_for(ObjectURL.parse(url))
    obs = object_store.obstore_module()
    for rel, data in _tree_bytes(path).items():
        if os.path.isfile(os.path.join(path, rel)) and not os.path.islink(os.path.join(path, rel)):
            obs.put(store, f"run/{rel}", data)
    try:
        _read_steps(url)
        jckpt.info(url).render()
    except CheckpointError as e:
        if url not in str(e):
            raise Disallowed(f"a bucket's error does not name it: {e}") from None
    finally:
        object_store._MEMORY.pop(f"fuzz{_BUCKETS[0]}", None)
        object_store.forget_stores()
    jckpt.verify(url)


_BUCKETS = [0]


def _check_trainer_state(path: str) -> str:
    from jckpt.errors import CheckpointError
    from jckpt.services.trainer_state import TrainerState

    text = open(path, "rb").read().decode("utf-8", "surrogateescape")
    try:
        state = TrainerState.from_json(text, file=path)
    except CheckpointError as e:
        if path not in str(e):
            raise Disallowed(f"error does not name the file: {e}") from None
        return "refused:" + type(e).__name__
    assert len(state.layout) == 3
    if TrainerState.from_json(state.to_json(), file=path).to_json() != state.to_json():
        raise Disallowed("a trainer state read does not survive to_json and back")
    return "loaded"


MAKERS = {"manager": make_manager, "trainer_state": make_trainer_state}
fuzz_formats.EXTENSIONS.update({"manager": "", "trainer_state": ".json"})


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import logging
    logging.getLogger("jckpt").setLevel(logging.ERROR)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(fuzz_formats.main(makers=MAKERS, check=check_manager, doc=__doc__))
