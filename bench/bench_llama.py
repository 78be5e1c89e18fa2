"""A llama-like training state on 8 CPU devices: what a training job does with checkpoints.

    python bench/bench_llama.py                  # ~1.5 GB state, 5 repetitions
    python bench/bench_llama.py --quick          # ~100 MB state, 2 repetitions
    python bench/bench_llama.py --only tools     # one part: save, manager, partial, tools

The state: bfloat16 weights in per-layer dicts (``layer_00: {attn: {wq, wk, wv,
wo}, mlp: {w1, w2, w3}, norm1, norm2}``, an embedding and a final norm), Adam's
float32 ``mu`` and ``nu`` of the same structure, and a step counter; matrices
sharded ``P('data', 'model')`` over a (2, 4) mesh, vectors over ``'model'``.
Against orbax (``StandardCheckpointer`` / ``CheckpointManager``) and
safetensors (``safetensors.flax.save_file``, ``safetensors.numpy.load_file``
followed by ``jax.device_put``), with the physical floor of the same bytes
measured in the same repetition (``raw``: one write and fsync; one
``readinto``). Each part prints medians and ratios to jckpt:

* ``save``: durable saves (every tool's files fsynced), then restores onto the
  same mesh, onto a (4, 2) mesh and onto one device;
* ``manager``: ``save`` every step with ``keep_last=2`` (orbax: ``max_to_keep=2``):
  how long each call blocks, and how long until the step is durable;
* ``partial``: one layer restored from the whole state's file after the file
  was dropped from the page cache: seconds and bytes read from storage;
* ``tools``: ``jckpt verify``, ``jckpt inspect`` and ``jckpt diff`` on the file,
  each in a fresh process: seconds and peak resident memory (anonymous, and
  with touched file pages), against reading the file once (``cat``).
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

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jckpt
from bench.tools import fsync_tree, remove


def shapes(quick: bool) -> dict:
    """The parameters' structure: name -> shape (nested dicts)."""
    layers, d, ff, vocab = (2, 512, 1024, 4096) if quick else (8, 1024, 4096, 16384)
    layer = {"attn": {k: (d, d) for k in ("wq", "wk", "wv", "wo")},
             "mlp": {"w1": (d, ff), "w2": (ff, d), "w3": (d, ff)},
             "norm1": (d,), "norm2": (d,)}
    return {"embed": (vocab, d), "final_norm": (d,),
            "layers": {f"layer_{i:02d}": layer for i in range(layers)}}


def _spec(shape: tuple[int, ...]) -> P:
    return P("data", "model") if len(shape) == 2 else P("model") if shape else P()


def _placed(shape, mesh_or_device):
    if isinstance(mesh_or_device, jax.sharding.Mesh):
        return NamedSharding(mesh_or_device, _spec(shape))
    return SingleDeviceSharding(mesh_or_device)


def make_state(quick: bool, mesh) -> dict:
    """The state with random values (no compressor gains), placed on `mesh`."""
    key = [jax.random.key(0)]

    def leaf(shape, dtype):
        key[0], k = jax.random.split(key[0])
        fill = jax.jit(lambda k: jax.random.normal(k, shape, dtype),
                       out_shardings=_placed(shape, mesh))
        return fill(k)
    tree_shapes = shapes(quick)
    is_shape = lambda x: isinstance(x, tuple)
    params = jax.tree.map(lambda s: leaf(s, jnp.bfloat16), tree_shapes, is_leaf=is_shape)
    mu = jax.tree.map(lambda s: leaf(s, jnp.float32), tree_shapes, is_leaf=is_shape)
    nu = jax.tree.map(lambda s: leaf(s, jnp.float32), tree_shapes, is_leaf=is_shape)
    step = jax.device_put(jnp.int32(7), NamedSharding(mesh, P()))
    state = {"params": params, "opt": {"mu": mu, "nu": nu, "count": step}, "step": step}
    return jax.block_until_ready(state)


def target(state, where) -> dict:
    """`state`'s abstract tree placed on `where` (a mesh or one device)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                       sharding=_placed(a.shape, where)), state)


def nbytes(tree) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(tree))


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


# --- the tools ---------------------------------------------------------------------------

def save(tool: str, state, path: str) -> None:
    if tool == "jckpt":
        jckpt.save(jckpt.Context(), state, path)
    elif tool == "orbax":
        import orbax.checkpoint as ocp
        with ocp.StandardCheckpointer() as c:
            c.save(path, state)
            c.wait_until_finished()
        fsync_tree(path)
    elif tool == "safetensors":
        from safetensors.flax import save_file
        save_file(_flat(state), path)
        fsync_tree(path)
    else:  # raw: the same bytes, one write and fsync
        blob = np.empty(nbytes(state), np.uint8)
        with open(path, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        fsync_tree(os.path.dirname(path))


def restore(tool: str, spec, path: str):
    if tool == "jckpt":
        back = jckpt.restore(jckpt.Context(), spec, path)
    elif tool == "orbax":
        import orbax.checkpoint as ocp
        with ocp.StandardCheckpointer() as c:
            back = c.restore(path, spec)
    elif tool == "safetensors":
        from safetensors.numpy import load_file
        host = load_file(path)
        flat = _flat(spec)
        leaves = [host[k] for k in flat]
        back = jax.device_put(leaves, [s.sharding for s in flat.values()])
    else:  # raw: read the bytes once
        size = os.path.getsize(path)
        buf = np.empty(size, np.uint8)
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(buf))
        back = buf
    return jax.block_until_ready(back)


TOOLS = ("jckpt", "orbax", "safetensors", "raw")


def _rotated(items: tuple, rep: int) -> tuple:
    return items[rep % len(items):] + items[:rep % len(items)]


def _table(title: str, rows: dict[str, dict[str, float]], unit: str = "s") -> None:
    cols = list(next(iter(rows.values())))
    print(f"\n{title}")
    print(f"  {'tool':<13}" + "".join(f"{c:>16}" for c in cols))
    for tool, vals in rows.items():
        base = rows.get("jckpt", vals)
        cells = [f"{vals[c]:>8.3f}{unit} {vals[c] / base[c]:>5.2f}x" if vals[c] == vals[c]
                 else f"{'—':>16}" for c in cols]
        print(f"  {tool:<13}" + "".join(f"{x:>16}" for x in cells))
    print("  (median seconds; x = the tool's median / jckpt's, above 1: jckpt faster)")


def part_save(state, meshes, workdir: str, reps: int) -> str:
    """Durable saves and restores; returns the path of a jckpt file of the state, kept."""
    cols = {"save": None, "restore same": meshes["same"], "restore 4x2": meshes["4x2"],
            "restore 1 dev": meshes["1 dev"]}
    times = {t: {c: [] for c in cols} for t in TOOLS}
    for rep in range(reps + 1):  # round 0 warms up
        for tool in _rotated(TOOLS, rep):
            path = os.path.join(workdir, f"{tool}-{rep}")
            t = time.perf_counter()
            save(tool, state, path)
            if rep:
                times[tool]["save"].append(time.perf_counter() - t)
            for col, where in cols.items():
                if where is None:
                    continue
                t = time.perf_counter()
                back = restore(tool, target(state, where), path)
                if rep:
                    times[tool][col].append(time.perf_counter() - t)
                del back
            remove(path)
    _table("durable save, and restore (the file in the page cache)",
           {t: {c: statistics.median(v) for c, v in cs.items()} for t, cs in times.items()})
    kept = os.path.join(workdir, "state.jckpt")
    save("jckpt", state, kept)
    return kept


def part_manager(state, workdir: str, steps: int) -> None:
    """`save` every step with two steps kept: the caller's block and the time to durable."""
    import orbax.checkpoint as ocp
    rows = {}
    for tool in ("jckpt", "orbax"):
        d = os.path.join(workdir, f"mgr-{tool}")
        blocks, durable = [], []
        if tool == "jckpt":
            mgr = jckpt.CheckpointManager(d, keep_last=2)
        else:
            mgr = ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(max_to_keep=2))
        for step in range(1, steps + 1):
            t = time.perf_counter()
            if tool == "jckpt":
                mgr.save(step, state)
            else:
                mgr.save(step, args=ocp.args.StandardSave(state))
            t1 = time.perf_counter()
            mgr.wait_durable() if tool == "jckpt" else mgr.wait_until_finished()
            if tool == "orbax":
                fsync_tree(os.path.join(d, str(step)))
            t2 = time.perf_counter()
            if step > 1:  # the first save has nothing to delete
                blocks.append(t1 - t)
                durable.append(t2 - t)
        mgr.close()
        shutil.rmtree(d)
        rows[tool] = {"save blocks": statistics.median(blocks),
                      "save to durable": statistics.median(durable)}
    _table(f"manager: save every step, two kept ({steps - 1} steps counted)", rows)


def _drop_cache(path: str) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(x for x in f if x.startswith("read_bytes:")).split()[1])


def part_partial(state, mesh, kept: str, workdir: str, reps: int) -> None:
    """One layer's weights, moments included, from a file not in the page cache."""
    from safetensors import safe_open
    from safetensors.flax import save_file
    st = os.path.join(workdir, "state.safetensors")
    save_file(_flat(state), st)
    fsync_tree(st)
    layer = {"params": {"layers": {"layer_01": state["params"]["layers"]["layer_01"]}},
             "opt": {m: {"layers": {"layer_01": state["opt"][m]["layers"]["layer_01"]}}
                     for m in ("mu", "nu")}}
    spec = target(layer, mesh)
    flat = _flat(spec)
    got = {"jckpt": [], "safetensors": []}
    for _ in range(reps):
        for tool, path in (("jckpt", kept), ("safetensors", st)):
            _drop_cache(path)
            before, t = _read_bytes(), time.perf_counter()
            if tool == "jckpt":
                jax.block_until_ready(jckpt.restore(jckpt.Context(), spec, kept))
            else:
                with safe_open(st, "numpy") as f:
                    jax.block_until_ready(jax.device_put([f.get_tensor(k) for k in flat],
                                                         [s.sharding for s in flat.values()]))
            got[tool].append((time.perf_counter() - t, _read_bytes() - before))
    print(f"\npartial restore of one layer ({nbytes(layer) / 2**20:.0f} MiB of "
          f"{nbytes(state) / 2**20:.0f} MiB), file dropped from the page cache first")
    for tool, runs in got.items():
        print(f"  {tool:<13}{statistics.median(r[0] for r in runs):>8.3f}s "
              f"{statistics.median(r[1] for r in runs) / 2**20:>8.1f} MiB read")
    remove(st)


def _peak(cmd: list[str]) -> tuple[float, int, int]:
    """Seconds, and peak anonymous and total resident bytes of `cmd` (sampled every 5 ms)."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    anon = total = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        anon = max(anon, int(line.split()[1]) * 1024)
                    elif line.startswith("VmRSS:"):
                        total = max(total, int(line.split()[1]) * 1024)
        except (FileNotFoundError, ProcessLookupError):
            pass
        time.sleep(0.005)
    if proc.returncode not in (0, 1):  # diff exits 1 when the files differ
        raise RuntimeError(f"{cmd} failed: {proc.stderr.read().decode()[-2000:]}")
    return time.perf_counter() - t, anon, total


def part_tools(state, kept: str, workdir: str, reps: int) -> None:
    """The command line on the state's file: seconds and peak memory, fresh processes."""
    other = os.path.join(workdir, "other.jckpt")
    changed = dict(state, step=state["step"] + 1)
    jckpt.save(jckpt.Context(), changed, other)
    py = [sys.executable, "-m", "jckpt"]
    cmds = {"cat (floor)": ["cat", kept], "python -c pass": [sys.executable, "-c", "pass"],
            "jckpt verify": [*py, "verify", kept], "jckpt inspect": [*py, "inspect", kept],
            "jckpt diff": [*py, "diff", kept, other]}
    runs = {name: [] for name in cmds}
    for rep in range(reps):
        for name in _rotated(tuple(cmds), rep):
            runs[name].append(_peak(cmds[name]))
    print(f"\ncommand line on a {os.path.getsize(kept) / 2**20:.0f} MiB file (in the page cache)")
    print(f"  {'command':<16}{'seconds':>9}{'peak anon':>12}{'peak RSS':>12}")
    for name, rs in runs.items():
        s, a, tot = (statistics.median(r[i] for r in rs) for i in range(3))
        print(f"  {name:<16}{s:>9.3f}{a / 2**20:>8.0f} MiB{tot / 2**20:>8.0f} MiB")
    remove(other)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a ~100 MB state, 2 repetitions")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 5, quick 2)")
    ap.add_argument("--only", choices=("save", "manager", "partial", "tools"), action="append")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args(argv)
    reps = args.reps or (2 if args.quick else 5)
    parts = args.only or ["save", "manager", "partial", "tools"]
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    meshes = {"same": mesh, "4x2": jax.make_mesh((4, 2), ("data", "model")),
              "1 dev": jax.devices()[0]}
    state = make_state(args.quick, mesh)
    workdir = tempfile.mkdtemp(prefix="bench-llama-", dir=args.dir)
    print(f"jax {jax.__version__}, 8 CPU devices, mesh (2, 4); state {nbytes(state) / 1e9:.2f} GB "
          f"in {len(jax.tree.leaves(state))} arrays; {reps} repetitions; {os.cpu_count()} cores")
    try:
        if "save" in parts:
            kept = part_save(state, meshes, workdir, reps)
        else:
            kept = os.path.join(workdir, "state.jckpt")
            save("jckpt", state, kept)
        if "manager" in parts:
            part_manager(state, workdir, reps + 2)
        if "partial" in parts:
            part_partial(state, mesh, kept, workdir, reps)
        if "tools" in parts:
            part_tools(state, kept, workdir, reps)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
