"""Sharded checkpoints on 8 CPU devices: jckpt against orbax's ``StandardCheckpointer``.

    python bench/bench_sharded.py            # ~1 GiB pytree and 2,000 small arrays, 5 repetitions
    python bench/bench_sharded.py --quick    # 64 MiB and 200 arrays, 2 repetitions (seconds)

Two workloads, both saved from a (4, 2) mesh with ``P('data', 'model')`` and
restored onto a (2, 4) mesh with ``P(None, 'a')`` (so every restore reshards):

* ``large``: 8 float32 arrays of 128 MiB each (~1 GiB in all);
* ``small``: 2,000 float32 arrays of 64 x 16 elements.

Each repetition runs every variant once, in a rotating order, on a fresh
directory; reported are the median seconds, jckpt's ratio to orbax in the same
run (orbax / jckpt: above 1 means jckpt is faster) and the peak growth of the
process's resident memory during restore, anonymous (allocated) and total
(which also counts touched pages of mapped files, i.e. page cache), sampled
every millisecond; restored arrays live in host memory on the CPU backend, so
both include them.
jckpt saves durably (fsync) as by default; ``jckpt-nosync`` is
``Context(durable=False)``, closer to what orbax does by default.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jckpt

VARIANTS = ("jckpt", "jckpt-nosync", "orbax")


def workloads(quick: bool) -> dict[str, list[tuple[int, ...]]]:
    if quick:
        return {"large": [(1024, 2048)] * 8, "small": [(64, 16)] * 200}
    return {"large": [(8192, 4096)] * 8, "small": [(64, 16)] * 2000}


def make_tree(shapes, mesh) -> dict[str, jax.Array]:
    s = NamedSharding(mesh, P("data", "model"))
    gens = {shape: jax.jit(lambda k, shape=shape: jax.random.normal(k, shape), out_shardings=s)
            for shape in set(shapes)}
    tree = {}
    for i, shape in enumerate(shapes):
        tree[f"a{i:04d}"] = gens[shape](jax.random.key(i))
    jax.block_until_ready(tree)
    return tree


def abstract(tree, mesh):
    s = NamedSharding(mesh, P(None, "a"))
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s) for k, v in tree.items()}


def rss() -> tuple[int, int]:
    """``(anonymous, total)`` resident bytes of this process (Linux ``/proc/self/status``)."""
    anon = total = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith("VmRSS:"):
                total = int(line.split()[1]) * 1024
    return anon, total


class PeakRSS:
    """Peak growth of resident memory while the block runs (sampled every millisecond).

    ``anon`` counts memory the process allocated; ``total`` also counts pages
    of mapped files it touched (page cache, which the kernel can drop).
    """

    def __init__(self) -> None:
        self.anon = self.total = 0

    def _sample(self) -> None:
        anon, total = rss()
        self.anon = max(self.anon, anon - self.base[0])
        self.total = max(self.total, total - self.base[1])

    def __enter__(self):
        self.base = rss()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop.is_set():
            self._sample()
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self._sample()


def save_variant(variant, tree, path) -> None:
    if variant.startswith("jckpt"):
        jckpt.save(jckpt.Context(durable=(variant == "jckpt")), tree, path)
    else:
        import orbax.checkpoint as ocp
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(path, tree)
            ckptr.wait_until_finished()


def restore_variant(variant, target, path):
    if variant.startswith("jckpt"):
        back = jckpt.restore(jckpt.Context(), target, path)
    else:
        import orbax.checkpoint as ocp
        with ocp.StandardCheckpointer() as ckptr:
            back = ckptr.restore(path, target)
    jax.block_until_ready(back)
    return back


def measure_child(variant: str, path: str, workload: str, quick: bool) -> None:
    """In a fresh process: restore once, print the peak memory growth (bytes) as one line."""
    shapes = workloads(quick)[workload]
    mesh = jax.make_mesh((2, 4), ("b", "a"))
    s = NamedSharding(mesh, P(None, "a"))
    target = {f"a{i:04d}": jax.ShapeDtypeStruct(shape, np.float32, sharding=s)
              for i, shape in enumerate(shapes)}
    if variant == "orbax":
        import orbax.checkpoint  # noqa: F401  (imported before measuring)
    gc.collect()
    with PeakRSS() as mem:
        back = restore_variant(variant, target, path)
    del back
    print(f"PEAK {mem.anon} {mem.total}", flush=True)


def fresh_process_peaks(variant, tree, workdir, workload, quick) -> tuple[int, int]:
    """Peak anonymous and total RSS growth of a restore in a new process (no reused heap)."""
    import subprocess
    path = os.path.join(workdir, f"mem-{variant}")
    save_variant(variant, tree, path)
    try:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure-child", variant,
                              path, workload] + (["--quick"] if quick else []),
                             capture_output=True, text=True, timeout=600)
        line = [x for x in out.stdout.splitlines() if x.startswith("PEAK ")]
        if not line:
            raise RuntimeError(f"measuring {variant} failed:\n{out.stderr[-3000:]}")
        anon, total = map(int, line[0].split()[1:])
        return anon, total
    finally:
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)


def run_variant(variant, tree, target, workdir, rep):
    """``(save seconds, restore seconds)`` of one variant, checking what comes back."""
    path = os.path.join(workdir, f"{variant}-{rep}")
    t0 = time.perf_counter()
    save_variant(variant, tree, path)
    t1 = time.perf_counter()
    gc.collect()
    t2 = time.perf_counter()
    back = restore_variant(variant, target, path)
    t3 = time.perf_counter()
    key = sorted(tree)[len(tree) // 2]
    assert back[key].sharding == target[key].sharding
    assert np.array_equal(np.asarray(back[key]), np.asarray(tree[key])), variant
    del back
    gc.collect()
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)
    return t1 - t0, t3 - t2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, 2 repetitions")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 5, quick 2)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--measure-child", nargs=3, metavar=("VARIANT", "PATH", "WORKLOAD"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure_child:
        measure_child(*args.measure_child, quick=args.quick)
        return 0
    reps = args.reps or (2 if args.quick else 5)
    assert jax.device_count() == 8, jax.devices()
    save_mesh = jax.make_mesh((4, 2), ("data", "model"))
    restore_mesh = jax.make_mesh((2, 4), ("b", "a"))
    workdir = tempfile.mkdtemp(prefix="bench-sharded-", dir=args.dir)
    print(f"jax {jax.__version__}, {jax.device_count()} CPU devices; save mesh (4, 2) "
          f"P('data', 'model'), restore mesh (2, 4) P(None, 'a'); {reps} repetitions; in {workdir}")
    try:
        for name, shapes in workloads(args.quick).items():
            tree = make_tree(shapes, save_mesh)
            target = abstract(tree, restore_mesh)
            nbytes = sum(v.nbytes for v in tree.values())
            times = {v: ([], []) for v in VARIANTS}
            for rep in range(reps + 1):  # the first round warms up and is not counted
                order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]
                for variant in order:
                    got = run_variant(variant, tree, target, workdir, rep)
                    if rep:
                        for lst, x in zip(times[variant], got):
                            lst.append(x)
            med = {v: tuple(statistics.median(x) for x in times[v][:2]) for v in VARIANTS}
            print(f"\n{name}: {len(shapes)} arrays, {nbytes / 2**20:.0f} MiB")
            for v in ("jckpt", "orbax"):
                med[v] = med[v][:2] + fresh_process_peaks(v, tree, workdir, name, args.quick)
            med["jckpt-nosync"] = med["jckpt-nosync"][:2] + med["jckpt"][2:]
            print(f"  {'variant':<14}{'save s':>9}{'restore s':>11}{'peak anon':>12}"
                  f"{'peak RSS':>12}{'save x':>9}{'restore x':>11}")
            for v in VARIANTS:
                s, r, anon, total = med[v]
                ratio = (f"{med['orbax'][0] / s:>9.2f}{med['orbax'][1] / r:>11.2f}"
                         if v != "orbax" else f"{'1.00':>9}{'1.00':>11}")
                print(f"  {v:<14}{s:>9.3f}{r:>11.3f}{anon / 2**20:>8.0f} MiB{total / 2**20:>8.0f} MiB"
                      f"{ratio}")
            del tree, target
            gc.collect()
        print("\n(x = orbax median / variant median, above 1 is faster than orbax; peak anon and "
              "peak RSS: growth of anonymous and of total resident memory during one restore in a "
              "fresh process, the restored arrays included; jckpt-nosync restores like jckpt)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
