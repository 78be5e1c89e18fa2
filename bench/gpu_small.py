"""Many small arrays onto an accelerator and off it, against one packed transfer of their bytes.

Run on a machine with a GPU or TPU (`python -m bench.gpu_small`); on the CPU it
runs too, where restores alias the file and nothing is packed. Prints one JSON
object: medians in milliseconds, and the ratio the goal is stated in
(restore / one packed transfer, at most 3), once the split of the arrays is compiled
(in the background since the second restore; the first two go array by array, and
`split_compile_wait_ms` is how long the compilation went on after the second). Off the device, `take_ms` is what a
snapshot's drain does with the arrays (`to_host.host_leaves(..., snapshot=True)`: into pinned
host memory, small arrays joined on the device once that join is compiled), against
`take_one_by_one_ms` (no joins) and one transfer of the packed bytes
(`one_packed_d2h_ms`); each run starts from fresh device arrays, which no host
copy is cached for.
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
from jckpt.trees import batched_put, compiled, packing, to_host


def _median(fn, reps: int, prepare=None) -> float:
    """Median milliseconds of `fn()` (of `fn(prepare())` with a `prepare`, untimed)."""
    times = []
    for _ in range(reps):
        args = () if prepare is None else (jax.block_until_ready(prepare()),)
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def takes(leaves: list[np.ndarray], device, reps: int) -> dict:
    """Milliseconds to bring `leaves`, on `device`, back to host: joined, one by one, and the
    packed bytes as one array."""
    on_device = jax.device_put(leaves, device)
    fresh = jax.jit(lambda xs: [x + 0 for x in xs])
    named = [(f"ns/w{i}", None) for i in range(len(leaves))]

    def take(xs):
        return [h.array for h in to_host.host_leaves(
            [(n, x) for (n, _), x in zip(named, xs)], snapshot=True)]
    take(fresh(on_device))  # the join compiles in the background: wait for it
    compiled.wait_all()
    out = {"take_ms": _median(take, reps, lambda: fresh(on_device))}
    kept, packing.TAKE_BYTES = packing.TAKE_BYTES, 0
    try:
        out["take_one_by_one_ms"] = _median(take, reps, lambda: fresh(on_device))
    finally:
        packing.TAKE_BYTES = kept
    packed = jax.device_put(np.concatenate([a.reshape(-1).view(np.uint8) for a in leaves]), device)
    out["one_packed_d2h_ms"] = _median(np.asarray, reps, lambda: packed + 0)
    out["take_over_packed_d2h"] = out["take_ms"] / out["one_packed_d2h_ms"]
    return out


def main(count: int = 2000, elements: int = 1000, reps: int = 7) -> dict:
    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    tree = {f"w{i:04d}": rng.random(elements, dtype=np.float32) for i in range(count)}
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
    scratch = tempfile.TemporaryDirectory()  # removed when main returns
    path = os.path.join(scratch.name, "small.jckpt")
    jckpt.save(jckpt.Context(), tree, path)
    leaves = list(tree.values())
    packed = np.concatenate(leaves)
    ctx = jckpt.Context(device=device)
    start = time.perf_counter()
    jax.block_until_ready(jckpt.restore(ctx, spec, path))
    first = (time.perf_counter() - start) * 1e3  # array by array: its split is not compiled
    start = time.perf_counter()
    jax.block_until_ready(jckpt.restore(ctx, spec, path))  # starts the split's compilation
    second = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    compiled.wait_all()
    compile_ms = (time.perf_counter() - start) * 1e3
    packing.put_packed(leaves, device), packing.put_packed(leaves, device)  # (on the CPU too)
    compiled.wait_all()
    out = {
        "platform": device.platform, "arrays": count, "bytes": int(packed.nbytes),
        "first_restore_ms": first, "second_restore_ms": second,
        "split_compile_wait_ms": compile_ms,
        "one_packed_transfer_ms": _median(lambda: jax.device_put(packed, device), reps),
        "restore_ms": _median(lambda: jckpt.restore(ctx, spec, path), reps),
        "device_put_list_ms": _median(lambda: jax.device_put(leaves, device), reps),
        "put_packed_ms": _median(lambda: packing.put_packed(leaves, device), reps),
        "one_by_one_ms": _median(lambda: batched_put._put_batch(leaves, [device] * count), reps),
        "packing_used": batched_put._accelerator(device) is not None,
    }
    out["restore_over_packed_transfer"] = out["restore_ms"] / out["one_packed_transfer_ms"]
    out.update(takes(leaves, device, reps))
    return out


if __name__ == "__main__":
    print(json.dumps(main(*map(int, sys.argv[1:])), indent=1))
