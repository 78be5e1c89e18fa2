"""What importing jckpt costs, against its dependencies and peers, each in a fresh interpreter.

    python bench/bench_import.py            # 7 repetitions
    python bench/bench_import.py --reps 3

Each module is imported by ``python -X importtime -c 'import M'`` in a new process
(the modules in a rotating order each repetition); reported is the median of the
cumulative import time Python measures for ``M``, and the median wall time of
``python -m jckpt inspect`` on a small bfloat16 file (the interpreter's start
included: ``python -c pass`` is its floor). ``import jckpt`` loads no JAX and,
since reading a header needs only precs' names and sizes, no ml_dtypes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODULES = ("numpy", "ml_dtypes", "jckpt", "jckpt.format", "safetensors.numpy", "jax",
           "orbax.checkpoint")


def import_seconds(module: str) -> float:
    """The cumulative import time of `module` in a fresh interpreter, as `-X importtime` says."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                         capture_output=True, text=True, check=True).stderr
    line = next(x for x in reversed(out.splitlines()) if x.rstrip().endswith(f"| {module}"))
    return int(line.split("|")[1]) / 1e6


def wall(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bf16.jckpt")
        subprocess.run([sys.executable, "-c", "import numpy as np, ml_dtypes, jckpt; jckpt.save("
                        "jckpt.Context(), {'w': np.ones((64, 64), ml_dtypes.bfloat16)}, "
                        f"{path!r})"], check=True)
        cmds = {"python -c pass": [sys.executable, "-c", "pass"],
                "jckpt inspect": [sys.executable, "-m", "jckpt", "inspect", path],
                "jckpt verify": [sys.executable, "-m", "jckpt", "verify", path]}
        times: dict[str, list[float]] = {name: [] for name in (*MODULES, *cmds)}
        names = list(times)
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                times[name].append(wall(cmds[name]) if name in cmds else import_seconds(name))
    print(f"median of {args.reps}, fresh interpreters; {os.cpu_count()} cores")
    for name, ts in times.items():
        what = name if name in cmds else f"import {name}"
        print(f"  {what:<26}{statistics.median(ts) * 1e3:>9.0f} ms")


if __name__ == "__main__":
    main()
