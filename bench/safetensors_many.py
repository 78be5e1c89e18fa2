"""Reading safetensors files of many small tensors: jckpt against safetensors' own reader.

`python -m bench.safetensors_many [reps]` writes, with safetensors' `save_file`,
a file of 2,000 float32 tensors of 1,000 elements and one of 200,000 float32
tensors of 16 elements, then times, interleaved in one process (medians of
`reps`, 5 by default): `jckpt.adapters.read`, safetensors' numpy `load_file`
and `safe_open` (every tensor got) of each, and `jckpt inspect` of the
200,000-tensor file (the command's function called in-process, its output
discarded). Prints one line per timing and the ratios the goals name:
jckpt read over `load_file` (goal <= 1.0) and inspect over read (goal < 2).

It also writes the 200,000 tensors as jckpt's safetensors writer does, from a nested
tree (`{'layers': {'0': {'w': ...}, ...}}`, so the file carries its paths record), and
times its read, and the tree rebuilt from the record (`tree_from_names`) against the
same names nested by their dots (`nest_dotted`): rebuilding costs about what nesting does
(goal <= 1.5x). `python -m bench.safetensors_many --rebuild [reps]` times these two alone
(medians of `reps`, 9 by default, interleaved), without the safetensors package.
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from jckpt import adapters
from jckpt.adapters._common import nest_dotted, tree_from_names
from jckpt.adapters.safetensors import PATHS_KEY, read_arrays
from jckpt.tools import cli

SHAPES = {'2000x1000': (2_000, 1_000), '200000x16': (200_000, 16)}


def _write(path: str, count: int, size: int) -> None:
    from safetensors.numpy import save_file
    row = np.arange(size, dtype=np.float32)
    save_file({f"layers.{i}.w": row for i in range(count)}, path)


def _safe_open(path: str) -> None:
    from safetensors import safe_open
    with safe_open(path, framework='numpy') as f:
        for k in f.keys():
            f.get_tensor(k)


def _inspect(path: str) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(['inspect', path])


def _write_own(path: str, count: int, size: int) -> None:
    row = np.arange(size, dtype=np.float32)
    adapters.write({'jckpt': {'layers': {str(i): {'w': row} for i in range(count)}}}, path)


def _rebuild(path: str) -> None:
    arrays, metadata = read_arrays(path)
    start = time.perf_counter()
    tree_from_names(arrays, metadata[PATHS_KEY])
    _rebuild.seconds = time.perf_counter() - start  # type: ignore[attr-defined]


def _nest(path: str) -> None:
    arrays, _ = read_arrays(path)
    start = time.perf_counter()
    nest_dotted(arrays, path)
    _nest.seconds = time.perf_counter() - start  # type: ignore[attr-defined]


def _timed(fn, path: str) -> float:
    start = time.perf_counter()
    fn(path)
    return time.perf_counter() - start


def main(reps: int = 5) -> None:
    from safetensors.numpy import load_file
    runs = {'jckpt read': adapters.read, 'load_file': load_file, 'safe_open': _safe_open}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for label, (count, size) in SHAPES.items():
            paths[label] = os.path.join(tmp, f"{label}.safetensors")
            _write(paths[label], count, size)
        cases = [(f"{label} {name}", fn, path) for label, path in paths.items()
                 for name, fn in runs.items()]
        cases.append(('200000x16 jckpt inspect', _inspect, paths['200000x16']))
        own = os.path.join(tmp, 'own.safetensors')
        _write_own(own, *SHAPES['200000x16'])
        cases += [('200000x16 own file read', adapters.read, own),
                  ('  rebuilt from its record', _rebuild, own),
                  ('  names nested by dots', _nest, own)]
        times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
        for _ in range(reps):
            for name, fn, path in cases:
                took = _timed(fn, path)
                times[name].append(getattr(fn, 'seconds', took))  # the part measured, if one
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, m in med.items():
        print(f"{name:28s} {m * 1e3:9.1f} ms (median of {reps})")
    for label in SHAPES:
        print(f"{label}: jckpt read / load_file = "
              f"{med[f'{label} jckpt read'] / med[f'{label} load_file']:.2f}x (goal <= 1.0)")
    print(f"200000x16: inspect / jckpt read = "
          f"{med['200000x16 jckpt inspect'] / med['200000x16 jckpt read']:.2f}x (goal < 2)")
    print(f"200000x16: rebuilt from the record / nested by dots = "
          f"{med['  rebuilt from its record'] / med['  names nested by dots']:.2f}x (goal <= 1.5)")


def rebuild_ratio(reps: int = 9) -> float:
    """The tree rebuilt from a jckpt-written file's paths record over its names nested by
    dots, 200,000 tensors (medians of `reps`, interleaved in this process); printed too."""
    with tempfile.TemporaryDirectory() as tmp:
        own = os.path.join(tmp, 'own.safetensors')
        _write_own(own, *SHAPES['200000x16'])
        rebuilt, nested = [], []
        for _ in range(reps):
            _timed(_rebuild, own)
            rebuilt.append(_rebuild.seconds)  # type: ignore[attr-defined]
            _timed(_nest, own)
            nested.append(_nest.seconds)  # type: ignore[attr-defined]
    r, n = statistics.median(rebuilt), statistics.median(nested)
    print(f"200000x16: rebuilt from the record {r * 1e3:.1f} ms, nested by dots {n * 1e3:.1f} ms: "
          f"{r / n:.2f}x (goal <= 1.5; medians of {reps})")
    return r / n


if __name__ == '__main__':
    args = [a for a in sys.argv[1:] if a != '--rebuild']
    if '--rebuild' in sys.argv[1:]:
        rebuild_ratio(int(args[0]) if args else 9)
    else:
        main(int(args[0]) if args else 5)
