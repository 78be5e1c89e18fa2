"""A save of many small arrays against safetensors and a raw file, interleaved in one process.

`python -m bench.small_save [reps] [--python] [--over]` saves the 2,000 float32 arrays of
1,000 elements (as `jax.Array`s on the CPU, as `bench.run` holds them) with
`jckpt.save`, not durable and durable, with safetensors' `save_file`, and as a
raw file (one `write` per array; durable: `fsync` of the file and its
directory), `reps` times each in turn (21 by default), and prints the medians
and jckpt's ratios against the issue's goals (save ≤ 1.0x safetensors, durable
save ≤ 1.3x the raw file). `--python` turns the C paths of a save off (staging,
entries, gathered writes), to show what they are worth. `--over` saves each file over
the one before instead of into an empty directory, as a training loop saving to one
path does: replacing a file frees the old one's cached pages, inside `open(O_TRUNC)` for
the raw file and safetensors, and on a background thread for jckpt
(`jckpt.storage.publish.replace`).

Unlike `bench.run`, nothing else (restores, loads, a mirror) runs between the
saves, so the page cache and the allocator are the same for every writer.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

import jax
import numpy as np

import jckpt
from bench import workloads
from bench.run import clock, to_device
from jckpt.api import saving
from jckpt.storage import writer
from jckpt.trees import to_host


def _writers(tree, folder: str) -> dict:
    from safetensors.numpy import save_file

    path = os.path.join(folder, 'out')
    fast, durable = jckpt.Context(durable=False), jckpt.Context()

    def raw(sync: bool) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for leaf in jax.tree.leaves(tree):
                os.write(fd, np.asarray(leaf))
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if sync:
            dfd = os.open(folder, os.O_RDONLY)
            os.fsync(dfd)
            os.close(dfd)

    return {'jckpt save': lambda: jckpt.save(fast, tree, path),
            'safetensors save': lambda: save_file({k: np.asarray(v) for k, v in tree.items()}, path),
            'raw write': lambda: raw(False),
            'jckpt durable save': lambda: jckpt.save(durable, tree, path),
            'raw write + fsync': lambda: raw(True)}


def main(reps: int = 21, python: bool = False, over: bool = False) -> dict[str, float]:
    switches = to_host.ACCELERATE, saving.ACCELERATE, writer.accelerator
    if python:
        to_host.ACCELERATE = saving.ACCELERATE = False
        writer.accelerator = None
    try:
        return _run(reps, over)
    finally:
        to_host.ACCELERATE, saving.ACCELERATE, writer.accelerator = switches


def _run(reps: int, over: bool = False) -> dict[str, float]:
    tree = to_device(workloads.build('small'))
    with tempfile.TemporaryDirectory(prefix='jckpt-small-save-') as folder:
        return _timed_writers(_writers(tree, folder), folder, reps, over)


def _timed_writers(writers: dict, folder: str, reps: int, over: bool) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in writers}
    for _ in range(reps):
        for name, fn in writers.items():
            if not over and os.path.exists(os.path.join(folder, 'out')):
                os.unlink(os.path.join(folder, 'out'))
            times[name].append(clock(fn)[0])
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in medians.items():
        print(f"{name:20s} {t * 1e3:7.1f} ms")
    print(f"save / safetensors {medians['jckpt save'] / medians['safetensors save']:.2f}x (goal <= 1.0x)"
          f", durable save / raw {medians['jckpt durable save'] / medians['raw write + fsync']:.2f}x"
          " (goal <= 1.3x)")
    return medians


if __name__ == '__main__':
    args = [a for a in sys.argv[1:] if not a.startswith('--')]
    main(int(args[0]) if args else 21, python='--python' in sys.argv, over='--over' in sys.argv)
