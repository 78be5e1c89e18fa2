"""Restore of many small arrays onto an accelerator, against one packed transfer of their bytes.

Run on a machine with a GPU or TPU (`python -m bench.gpu_small`); on the CPU it
runs too, where restores alias the file and nothing is packed. Prints one JSON
object: medians in milliseconds, and the ratio the goal is stated in
(restore / one packed transfer, at most 3).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

import jckpt
from jckpt.trees import packing, placement


def _median(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(count: int = 2000, elements: int = 1000, reps: int = 7) -> dict:
    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    tree = {f"w{i:04d}": rng.random(elements, dtype=np.float32) for i in range(count)}
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
    path = os.path.join(tempfile.mkdtemp(), "small.jckpt")
    jckpt.save(jckpt.Context(), tree, path)
    leaves = list(tree.values())
    packed = np.concatenate(leaves)
    ctx = jckpt.Context(device=device)
    start = time.perf_counter()
    jax.block_until_ready(jckpt.restore(ctx, spec, path))
    first = (time.perf_counter() - start) * 1e3  # with the split's compilation
    out = {
        "platform": device.platform, "arrays": count, "bytes": int(packed.nbytes),
        "first_restore_ms": first,
        "one_packed_transfer_ms": _median(lambda: jax.device_put(packed, device), reps),
        "restore_ms": _median(lambda: jckpt.restore(ctx, spec, path), reps),
        "device_put_list_ms": _median(lambda: jax.device_put(leaves, device), reps),
        "put_packed_ms": _median(lambda: packing.put_packed(leaves, device), reps),
        "one_by_one_ms": _median(lambda: placement._put_batch(leaves, [device] * count), reps),
        "packing_used": placement._accelerator(device) is not None,
    }
    out["restore_over_packed_transfer"] = out["restore_ms"] / out["one_packed_transfer_ms"]
    return out


if __name__ == "__main__":
    print(json.dumps(main(*map(int, sys.argv[1:])), indent=1))
