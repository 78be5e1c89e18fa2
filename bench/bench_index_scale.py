"""A directory checkpoint's index at scale: 1k to 1M pieces, simulated on one machine.

    python bench/bench_index_scale.py                  # 1k, 10k, 100k and 1M pieces
    python bench/bench_index_scale.py --sizes 1k,10k   # some of them
    python bench/bench_index_scale.py --profile 100k   # cProfile of every phase at one size

A job of P processes saving A arrays, each array sharded over every process,
writes P x A pieces; 1,024 processes and 1,000 arrays make about a million.
This script writes such a directory from one process: P piece files of A
tiny pieces each (one element per piece, so the index, not the payload, is
what is measured), half the arrays 2-D and sharded over a 2-D mesh of the
processes, half 1-D and sharded over all of them, and one scalar written by
process 0. Then it times what process 0 and the readers do with the index:

* ``pieces``: writing the P piece files (in a real job, each process writes
  its own file at the same time; here one process writes them all, so this
  is P times one process's share);
* ``build``: process 0 reads every piece file's header and groups the pieces
  by array (the index's entries);
* ``check``: the writer's check that every array's pieces tile it;
* ``write``: the index encoded and written (``index.jckpt``);
* ``read``: the index read, decoded and validated (its overlap and coverage
  check included), as every reader does on opening the directory;
* ``plan one``: a restore by one process of P planned: the pieces that
  overlap its shard of every array;
* ``plan all``: a restore by one process of everything planned: the pieces
  of every array;
* ``read one``: that process's shard of every array read (one piece file
  opened).

Sizes (P processes x A arrays): 1k = 32 x 32, 10k = 100 x 100,
100k = 320 x 320, 1M = 1,024 x 1,000. Peak RSS is the process's high-water
mark after each size (sizes run smallest first).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import os
import pstats
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jckpt.format.entries import Header, entry_for
from jckpt.format.layout import lay_out
from jckpt.format.names import INDEX_NAME, PIECE_RE, piece_name
from jckpt.storage import directory
from jckpt.storage.backend import LOCAL
from jckpt.storage.writer import ArraySource, write_checkpoint

SIZES = {'1k': (32, 32), '10k': (100, 100), '100k': (320, 320), '1M': (1024, 1000)}
PHASES = ('pieces', 'build', 'check', 'write', 'read', 'plan one', 'plan all', 'read one')


def mesh(processes: int) -> tuple[int, int]:
    """The most nearly square (rows, cols) grid of ``processes``."""
    rows = max(r for r in range(1, math.isqrt(processes) + 1) if processes % r == 0)
    return rows, processes // rows


def array_box(k: int, p: int, processes: int) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """``(global dims, process p's box)`` of array ``k``: one element per process."""
    if k % 2:
        return (processes,), ((p, p + 1),)
    rows, cols = mesh(processes)
    i, j = divmod(p, cols)
    return (rows, cols), ((i, i + 1), (j, j + 1))


def write_pieces(stage: str, processes: int, arrays: int) -> None:
    """Every process's piece file, written here one after another."""
    one = np.ones((1,), np.float32)
    for p in range(processes):
        entries, sources = [], []
        for k in range(arrays):
            dims, box = array_box(k, p, processes)
            entries.append(entry_for('jckpt', (('k', f'layer{k // 2}'), ('k', 'wb'[k % 2])),
                                     np.float32, (1,) * len(dims), id=k, slice=box,
                                     global_dims=dims))
            sources.append(ArraySource(one.reshape((1,) * len(dims))))
        if p == 0:  # a replicated scalar, written once by process 0
            entries.append(entry_for('jckpt', (('k', 'step'),), np.int32, (), id=arrays,
                                     slice=(), global_dims=()))
            sources.append(ArraySource(np.int32(7).reshape(())))
        header = lay_out(Header(tensors=tuple(entries), alignment=32))
        write_checkpoint(os.path.join(stage, piece_name(p)), header, sources, durable=False)


def plan(arrays: Any, boxes: Callable[[Any], Any]) -> int:
    """Plan reading ``boxes(array)`` of every array: how many pieces overlap, in all."""
    return sum(len(directory.overlapping(a, boxes(a))) for a in arrays)


def run_size(name: str, root: str, profile: bool) -> dict[str, float]:
    processes, count = SIZES[name]
    stage = os.path.join(root, f"{name}.stage")
    os.mkdir(stage)
    times: dict[str, float] = {}
    state: dict[str, Any] = {}
    me = processes // 2

    def timed(phase: str, fn: Callable[[], Any]) -> None:
        prof = cProfile.Profile() if profile else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        state[phase] = fn()
        if prof:
            prof.disable()
        times[phase] = time.perf_counter() - t0
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats('cumulative').print_stats(25)
            print(f"--- {name} {phase} ---\n{s.getvalue()}", file=sys.stderr)

    names = None

    def build() -> Any:
        nonlocal names
        names = [n for n in LOCAL.list(stage) if PIECE_RE.match(n)]
        return directory.collect_arrays(stage, names)

    timed('pieces', lambda: write_pieces(stage, processes, count))
    timed('build', build)
    timed('check', lambda: directory.check_arrays(stage, state['build']))
    timed('write', lambda: directory.write_index_file(stage, names, processes, state['build'],
                                                      32, {}, durable=False))
    path = os.path.join(root, name)
    os.rename(stage, path)
    timed('read', lambda: directory.DirectoryReader(path))
    reader = state['read']
    arrays = list(reader.arrays.values())
    mine = {a.entry.identity: array_box(a.entry.id, me, processes)[1] if a.entry.dims else ()
            for a in arrays}
    timed('plan one', lambda: plan(arrays, lambda a: mine[a.entry.identity]))
    timed('plan all', lambda: plan(arrays, lambda a: tuple((0, d) for d in a.entry.dims)))
    timed('read one', lambda: sum(reader.read_box(a, mine[a.entry.identity]).size for a in arrays))
    assert state['plan one'] == len(arrays), state['plan one']
    assert state['plan all'] == sum(len(a.pieces) for a in arrays)
    assert os.path.exists(os.path.join(path, INDEX_NAME))
    shutil.rmtree(path)
    return times


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--sizes', default=','.join(SIZES), help='comma-separated, of ' + ', '.join(SIZES))
    ap.add_argument('--profile', default='', help='a size to profile (cProfile, to stderr)')
    ap.add_argument('--dir', default=None, help='where to write (default: a temporary folder)')
    args = ap.parse_args(argv)
    sizes = [args.profile] if args.profile else args.sizes.split(',')
    root = tempfile.mkdtemp(prefix='jckpt-index-scale-', dir=args.dir)
    try:
        print(f"{'pieces':>8} " + ' '.join(f"{p:>9}" for p in PHASES) + '  peak RSS')
        for name in sizes:
            processes, count = SIZES[name]
            times = run_size(name, root, bool(args.profile))
            n = processes * count + 1
            print(f"{n:>8} " + ' '.join(f"{times[p]:>8.3f}s" for p in PHASES)
                  + f"  {peak_rss_mib():.0f} MiB", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == '__main__':
    main()
