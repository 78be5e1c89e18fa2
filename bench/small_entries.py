"""Entries built in C against the Python loop, on many small arrays: `_entries` and a whole save.

`python -m bench.small_entries [reps]` times, interleaved in one process
(medians of `reps`, 15 by default), `jckpt.api.saving._entries` over the
host leaves of 2,000 float32 arrays of 1,000 elements with
`saving.ACCELERATE` off and on, a whole `jckpt.save` (not durable) likewise,
and safetensors' `save_file` of the same arrays for the ratio.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np

import jckpt
from bench import workloads
from jckpt.api import saving
from jckpt.format.entries import path_name
from jckpt.trees import pytree as tree_mod
from jckpt.trees import to_host


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _switched(accelerate: bool, fn):
    def run():
        saving.ACCELERATE = accelerate
        try:
            fn()
        finally:
            saving.ACCELERATE = True
    return run


def main(reps: int = 15) -> None:
    from safetensors.numpy import save_file
    tree = workloads.build('small')
    flat = dict(tree_mod.flatten(tree))
    paths = list(flat)
    hosts = to_host.host_leaves([(str(p), a) for p, a in flat.items()])
    named = {path_name(p): np.asarray(a) for p, a in flat.items()}
    scratch = tempfile.TemporaryDirectory()  # removed when main returns
    folder = scratch.name
    ctx = jckpt.Context(durable=False)
    runs = {
        'entries, Python': _switched(False, lambda: saving._entries(ctx, paths, hosts, alignment=32)),
        'entries, C': _switched(True, lambda: saving._entries(ctx, paths, hosts, alignment=32)),
        'save, Python': _switched(False, lambda: jckpt.save(ctx, tree, os.path.join(folder, 'p.jckpt'))),
        'save, C': _switched(True, lambda: jckpt.save(ctx, tree, os.path.join(folder, 'c.jckpt'))),
        'safetensors save_file': lambda: save_file(named, os.path.join(folder, 's.safetensors')),
    }
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            times[name].append(_timed(run))
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, m in medians.items():
        print(f"{name:24s} {m * 1e3:7.2f} ms  ({m / len(paths) * 1e6:5.2f} us per leaf)")
    safe = medians['safetensors save_file']
    print(f"save / safetensors: Python {medians['save, Python'] / safe:.2f}x, "
          f"C {medians['save, C'] / safe:.2f}x")


if __name__ == '__main__':
    main(*map(int, sys.argv[1:2]))
