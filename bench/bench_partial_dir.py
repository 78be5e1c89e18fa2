"""A directory checkpoint restored by another process count: the bytes each process reads.

    python bench/bench_partial_dir.py              # 512 MiB, 3 repetitions
    python bench/bench_partial_dir.py --mib 64     # a smaller state (seconds)

A state of 8 float32 arrays is written as a directory checkpoint by simulated writers
(each array's rows split into one piece per writer, one piece file per writer), then
restored by the processes of a `jax.distributed` run on the CPU, each restoring onto
its devices of a mesh of every process's:

* ``4 -> 2``: written by 4, restored by 2 processes whose mesh splits the columns
  (`P(None, "data")`, `data` across the processes): each needs half of every piece;
* ``2 -> 4``: written by 2, restored by 4 splitting the rows (`P("data")`): each needs
  half of one piece file.

Each process reads its own copy of the directory, dropped from the page cache first
(`POSIX_FADV_DONTNEED`), as a process on its own host would: the processes of one host
share its page cache, so one's read would serve another's. Reported, per process
(medians of the repetitions): the bytes read from storage (`/proc/self/io`
`read_bytes`) against the bytes its devices need, and the restore's seconds, with the
read plan (the kernel asked for exactly the planned byte ranges) and without it (the
reads as the kernel's read-ahead makes them, what a restore of every array did before),
alternating in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
ARRAYS = 8
COLS = 65536  # rows of 256 KiB (float32): half a row is past the 64 KiB a plan reads through


def write_state(path: str, writers: int, mib: int) -> None:
    """A directory checkpoint of `ARRAYS` arrays of `mib` MiB in all, as `writers` processes
    write it: each array's rows split evenly, one piece file per writer."""
    from jckpt.format import Entry, Header, lay_out, prec_of
    from jckpt.format.names import piece_name
    from jckpt.storage import ArraySource, write_checkpoint
    from jckpt.storage.directory import write_index

    rows = mib * 2**20 // ARRAYS // (COLS * 4)
    os.makedirs(path)
    for w in range(writers):
        lo, hi = rows * w // writers, rows * (w + 1) // writers
        entries, sources = [], []
        for i in range(ARRAYS):
            part = np.full((hi - lo, COLS), i + w, np.float32)
            entries.append(Entry(id=i, namespace="jckpt", prec=prec_of(part.dtype), dims=part.shape,
                                 offset=0, byte_length=part.nbytes, label=(f"a{i}",),
                                 path=(("k", f"a{i}"),), slice=((lo, hi), (0, COLS)),
                                 global_dims=(rows, COLS)))
            sources.append(ArraySource(part))
        write_checkpoint(os.path.join(path, piece_name(w)), lay_out(Header(tensors=tuple(entries))),
                         sources, durable=False)
    write_index(path, writers, 4096, {}, durable=False)


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(x for x in f if x.startswith("read_bytes:")).split()[1])


def _drop_cache(path: str) -> None:
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            os.fsync(f.fileno())  # a copy just written: its pages are dropped once written back
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def worker(process: int, processes: int, port: int, path: str, spec: str, reps: int) -> None:
    """One process of the run: restore its copy `reps` times with the plan and without."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
                               process_id=process, initialization_timeout=60)
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jckpt
    from jckpt.storage.directory import DirectoryReader

    mine = f"{path}.{process}"
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(processes, -1), ("data", "model"))
    sharding = NamedSharding(mesh, P(None, "data") if spec == "cols" else P("data"))
    shape = jckpt.describe(mine).tensors[0].dims
    target = {f"a{i}": jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
              for i in range(ARRAYS)}
    needed = ARRAYS * int(np.prod(shape)) * 4 // processes
    planned = DirectoryReader.advise
    runs: dict[str, list[tuple[float, int]]] = {"without plan": [], "with plan": []}
    jax.block_until_ready(jckpt.restore(jckpt.Context(), target, mine))  # warm, not measured
    for rep in range(reps):
        for variant in sorted(runs, reverse=rep % 2 == 1):
            DirectoryReader.advise = planned if variant == "with plan" else lambda *a, **k: None
            _drop_cache(mine)
            multihost_utils.sync_global_devices(f"{variant} {rep}")
            before, t = _read_bytes(), time.perf_counter()
            back = jax.block_until_ready(jckpt.restore(jckpt.Context(), target, mine))
            runs[variant].append((time.perf_counter() - t, _read_bytes() - before))
            del back
    print("RESULT " + json.dumps({"process": process, "needed": needed, "runs": runs}), flush=True)


def run(processes: int, path: str, spec: str, reps: int) -> list[dict]:
    """The results of the `processes` workers of one run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, HERE, "--worker", str(p), str(processes), str(port),
                               path, spec, str(reps)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for p in range(processes)]
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=1800)
        found = [json.loads(x[7:]) for x in text.splitlines() if x.startswith("RESULT ")]
        if not found:
            raise SystemExit(text[-3000:])
        out.extend(found)
    return out


def report(name: str, results: list[dict]) -> None:
    print(f"\n{name}: per process, medians of {len(results[0]['runs']['with plan'])}")
    print("  | process | needed | without plan | with plan |")
    print("  |---|---|---|---|")
    for r in sorted(results, key=lambda r: r["process"]):
        cells = []
        for variant in ("without plan", "with plan"):
            runs = r["runs"][variant]
            t, n = statistics.median(x[0] for x in runs), statistics.median(x[1] for x in runs)
            cells.append(f"{t:.3f} s, {n / 2**20:,.1f} MiB read ({n / r['needed']:.2f}x)")
        print(f"  | {r['process']} | {r['needed'] / 2**20:,.1f} MiB | {cells[0]} | {cells[1]} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="the state's size (default 512 MiB)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        p, n, port, path, spec, reps = args.worker
        worker(int(p), int(n), int(port), path, spec, int(reps))
        return 0
    workdir = tempfile.mkdtemp(prefix="jckpt-bench-", dir=args.dir)
    try:
        for name, writers, readers, spec in (("4 -> 2", 4, 2, "cols"), ("2 -> 4", 2, 4, "rows")):
            path = os.path.join(workdir, f"by{writers}")
            write_state(path, writers, args.mib)
            for p in range(readers):  # each process its own copy: its own page cache
                shutil.copytree(path, f"{path}.{p}")
            report(f"{name} processes ({args.mib} MiB written by {writers}, restored by "
                   f"{readers})", run(readers, path, spec, args.reps))
            for p in range(readers):
                shutil.rmtree(f"{path}.{p}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
