"""A manager directory of many steps: what opening, listing and retention cost.

    python bench/bench_manager_dir.py              # 1,000 steps, 5 repetitions
    python bench/bench_manager_dir.py --steps 100  # a smaller directory
    python bench/bench_manager_dir.py --profile    # pyinstrument (else cProfile) of one open

A training run that checkpoints often, and keeps its history, leaves a directory
of many steps. This script writes ``--steps`` small steps (a few arrays and
metrics each) with ``jckpt.CheckpointManager`` and as many with orbax's
``CheckpointManager`` (one step saved, the others copies of its directory, which
orbax reads alike), then times, median of the repetitions:

* ``listing``: ``os.listdir`` of the directory, the floor of any answer;
* ``open``: constructing a (writing) manager, which finds every step;
* ``open read-only``: constructing a reader (``read_only=True``);
* ``latest_step``, ``all_steps``: on an open manager;
* ``reload``: a reader's ``reload()`` of the unchanged directory;
* ``retention``: a manager with ``keep_last=2`` opened on a copy of the
  directory and one more step saved, so every other step is deleted;
* ``jckpt.info`` of the directory, and ``jckpt inspect`` of it on the command
  line, in a fresh process (so the interpreter's start is included, and measured
  alone as ``python -c pass``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp

import jckpt


def _tree() -> dict:
    return {"w": jnp.ones((16, 16)), "b": jnp.zeros(16), "step": jnp.int32(0)}


def write_jckpt(directory: str, steps: int) -> None:
    """`steps` steps written synchronously (no fsync, so the setup is quick)."""
    with jckpt.CheckpointManager(directory, ctx=jckpt.Context(durable=False),
                                 asynchronous=False) as mgr:
        tree = _tree()
        for step in range(1, steps + 1):
            mgr.save(step, tree, metrics={"loss": 1.0 / step})


def write_orbax(directory: str, steps: int) -> None:
    """One orbax step saved, the others copies of its directory under their own step names."""
    import orbax.checkpoint as ocp
    with ocp.CheckpointManager(directory) as mgr:
        mgr.save(1, args=ocp.args.StandardSave(_tree()), metrics={"loss": 1.0})
        mgr.wait_until_finished()
    for step in range(2, steps + 1):
        shutil.copytree(os.path.join(directory, "1"), os.path.join(directory, str(step)))


def _median(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _cli(*args: str) -> Callable[[], object]:
    return lambda: subprocess.run([sys.executable, *args], check=True, capture_output=True)


def _retention(src: str, scratch: str, steps: int) -> None:
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(src, scratch)
    t = time.perf_counter()
    with jckpt.CheckpointManager(scratch, keep_last=2, ctx=jckpt.Context(durable=False)) as mgr:
        mgr.save(steps + 1, _tree())
        mgr.wait_durable()
    return time.perf_counter() - t


def measure(root: str, steps: int, reps: int) -> dict[str, tuple[float, float | None]]:
    """name -> (jckpt seconds, orbax seconds or None), medians of `reps`."""
    import orbax.checkpoint as ocp
    ours, theirs = os.path.join(root, "jckpt"), os.path.join(root, "orbax")
    write_jckpt(ours, steps)
    write_orbax(theirs, steps)
    mgr = jckpt.CheckpointManager(ours, read_only=True)
    omgr = ocp.CheckpointManager(theirs, options=ocp.CheckpointManagerOptions(read_only=True))
    out: dict[str, tuple[float, float | None]] = {}
    out["listing"] = (_median(lambda: os.listdir(ours), reps), _median(lambda: os.listdir(theirs), reps))
    out["open"] = (_median(lambda: jckpt.CheckpointManager(ours).close(), reps),
                   _median(lambda: ocp.CheckpointManager(theirs).close(), reps))
    out["open read-only"] = (
        _median(lambda: jckpt.CheckpointManager(ours, read_only=True).close(), reps),
        _median(lambda: ocp.CheckpointManager(
            theirs, options=ocp.CheckpointManagerOptions(read_only=True)).close(), reps))
    out["latest_step"] = (_median(mgr.latest_step, reps), _median(omgr.latest_step, reps))
    out["all_steps"] = (_median(mgr.all_steps, reps), _median(omgr.all_steps, reps))
    out["reload"] = (_median(mgr.reload, reps), _median(omgr.reload, reps))
    scratch = os.path.join(root, "retention")
    out["retention (open, save, prune)"] = (
        statistics.median(_retention(ours, scratch, steps) for _ in range(reps)), None)
    out["python -c pass"] = (_median(_cli("-c", "pass"), reps), None)
    out["jckpt.info(DIR)"] = (_median(lambda: jckpt.info(ours), reps), None)
    out["jckpt inspect DIR"] = (_median(_cli("-m", "jckpt", "inspect", ours), reps), None)
    mgr.close()
    omgr.close()
    return out


def _profile(root: str, steps: int) -> None:
    ours = os.path.join(root, "jckpt")
    write_jckpt(ours, steps)
    try:
        from pyinstrument import Profiler
    except ImportError:
        import cProfile
        cProfile.runctx("jckpt.CheckpointManager(ours).close()", globals(), {"ours": ours},
                        sort="cumulative")
        return
    with Profiler() as p:
        jckpt.CheckpointManager(ours).close()
    p.print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench_manager_dir_")
    try:
        if args.profile:
            _profile(root, args.steps)
            return
        res = measure(root, args.steps, args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.steps} steps, median of {args.reps}; x = orbax / jckpt (above 1: jckpt faster)")
    print(f"  {'operation':<30} {'jckpt':>10} {'orbax':>10} {'x':>8}")
    for name, (a, b) in res.items():
        other = "—" if b is None else f"{b * 1e3:.2f}"
        ratio = "—" if b is None else f"{b / a:.2f}"
        print(f"  {name:<30} {a * 1e3:>8.2f}ms {other:>8}{'ms' if b is not None else '  '} {ratio:>8}")


if __name__ == "__main__":
    main()
