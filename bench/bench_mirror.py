"""A training loop that checkpoints every step: jckpt's mirror and manager against orbax's async manager.

    python -m bench.bench_mirror            # two model sizes, 5 repetitions
    python -m bench.bench_mirror --quick    # small sizes, 2 repetitions (seconds)
    python -m bench.bench_mirror --width 2048 --depth 4 --batch 16 --steps 20

On a CPU-only machine the training step itself uses every core, so the
background writer competes with it for CPU, which an accelerator run does not
do. To model a run whose compute is elsewhere, leave a core to the writer:

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \
        python -m bench.bench_mirror

The loop trains an MLP with Adam (``optax``), its state donated to each step
(so a checkpoint must copy it), and reads the loss every step. Variants, run
interleaved in a rotating order so a slow spell of the machine lands on all:

* ``none``: no checkpoint (the baseline).
* ``d2h``: a private host copy of the whole state every step (``copy_to_host_async``
  on every leaf, then ``np.array``): what any consistent snapshot costs at least.
* ``save``: ``jckpt.save`` every step, synchronous and durable.
* ``mirror``: ``jckpt.Mirror.submit`` every step, then ``wait_durable`` (inside the wall time).
* ``manager``: ``jckpt.CheckpointManager.save`` every step (``keep_last=2``).
* ``orbax``: ``orbax.checkpoint.CheckpointManager`` with async checkpointing,
  ``StandardSave`` every step (``max_to_keep=2``), ``wait_until_finished`` at the end.

Reported per variant: the loop's wall time (median) and its ratio to ``none``
(target for the mirror: <= 1.1x when the disk keeps up), the median time one
checkpoint call blocks the loop and its ratio to ``d2h`` (target: <= 1.2x), and
for the mirror the writer's time per snapshot (the disk keeps up when it is
below the step time).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jckpt

VARIANTS = ('none', 'd2h', 'save', 'mirror', 'manager', 'orbax')


def make_model(width: int, depth: int, batch: int):
    """``(initial state, jitted donating train step, batch)`` for an MLP of ``depth`` layers."""
    keys = jax.random.split(jax.random.key(0), depth)
    params = {f"layer{i}": {"w": jax.random.normal(k, (width, width)) / np.sqrt(width),
                            "b": jnp.zeros(width)} for i, k in enumerate(keys)}
    opt = optax.adam(1e-4)

    def loss_fn(p, x):
        h = x
        for i in range(depth):
            h = jnp.tanh(h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
        return jnp.mean((h - x) ** 2)

    def step(state, x):
        loss, g = jax.value_and_grad(loss_fn)(state["params"], x)
        updates, opt_state = opt.update(g, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
                "step": state["step"] + 1}, loss

    def fresh():
        return {"params": jax.tree.map(jnp.copy, params), "opt_state": opt.init(params),
                "step": jnp.int32(0)}

    x = jax.random.normal(jax.random.key(1), (batch, width))
    return fresh, jax.jit(step, donate_argnums=0), x


def host_copy(state) -> list[np.ndarray]:
    """The ``d2h`` variant: a private host copy of every leaf, transfers overlapped."""
    leaves = jax.tree.leaves(state)
    for leaf in leaves:
        leaf.copy_to_host_async()
    return [np.array(leaf) for leaf in leaves]


def run_variant(name: str, fresh, step, x, steps: int, directory: str) -> dict[str, float]:
    """One loop of ``steps`` steps; returns wall time and the median blocking time per call."""
    state = fresh()
    state, loss = step(state, x)  # compile and warm up outside the timing
    float(loss)
    blocks: list[float] = []
    unstalled: list[float] = []  # mirror/manager calls that found a free slot: the copy alone
    extra: dict[str, float] = {}
    sink = None
    if name == 'mirror':
        sink = jckpt.Mirror(os.path.join(directory, 'mirror.jckpt'))
    elif name == 'manager':
        sink = jckpt.CheckpointManager(os.path.join(directory, 'mgr'), keep_last=2)
    elif name == 'orbax':
        import orbax.checkpoint as ocp

        sink = ocp.CheckpointManager(os.path.join(directory, 'orbax'), options=ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=True))
    ctx = jckpt.Context()

    def checkpoint(i: int) -> None:
        if name == 'd2h':
            host_copy(state)
        elif name == 'save':
            jckpt.save(ctx, state, os.path.join(directory, 'sync.jckpt'))
        elif name == 'mirror':
            sink.submit(state)
        elif name == 'manager':
            sink.save(i, state)
        elif name == 'orbax':
            import orbax.checkpoint as ocp

            sink.save(i, args=ocp.args.StandardSave(state))

    def drain() -> None:
        if name in ('mirror', 'manager'):
            sink.wait_durable()
        elif name == 'orbax':
            sink.wait_until_finished()

    # Warm-up outside the timing: two checkpoints (every slot's buffers touched once).
    for i in (1, 2):
        state, loss = step(state, x)
        float(loss)
        checkpoint(i)
    drain()
    warm_stalls = sink.counters.stalls if name in ('mirror', 'manager') else 0
    start = time.perf_counter()
    for i in range(3, steps + 3):
        state, loss = step(state, x)
        float(loss)
        stalls = sink.counters.stalls if name in ('mirror', 'manager') else 0
        t0 = time.perf_counter()
        checkpoint(i)
        blocks.append(time.perf_counter() - t0)
        if name in ('mirror', 'manager') and sink.counters.stalls == stalls:
            unstalled.append(blocks[-1])
    drain()
    jax.block_until_ready(state)
    wall = time.perf_counter() - start
    if name in ('mirror', 'manager'):
        c = sink.counters
        extra['counters'] = str(c)
        extra['stalls'] = c.stalls - warm_stalls
        extra['copy'] = statistics.median(unstalled) if unstalled else float('nan')
        sink.close()
    elif name == 'orbax':
        sink.close()
    return {'wall': wall, 'block': statistics.median(blocks) if name != 'none' else 0.0,
            'step': wall / steps, **extra}


def writer_time(fresh, step, x, directory: str, n: int = 3) -> float:
    """Median seconds the mirror's writer spends per snapshot (nothing else running)."""
    state, _ = step(fresh(), x)
    times = []
    with jckpt.Mirror(os.path.join(directory, 'writer.jckpt'), slots=1) as m:
        for _ in range(n):
            state, _ = step(state, x)
            jax.block_until_ready(state)
            m.submit(state)
            t0 = time.perf_counter()
            m.wait_durable()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(width: int, depth: int, batch: int, steps: int, reps: int, variants, root: str) -> None:
    fresh, step, x = make_model(width, depth, batch)
    state = fresh()
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    del state
    print(f"\n## MLP width {width}, depth {depth}, batch {batch}: state {nbytes / 2**20:.0f} MiB "
          f"(params + Adam), {steps} steps, {reps} repetitions, checkpoint every step")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(reps):
        order = list(variants[r % len(variants):]) + list(variants[:r % len(variants)])
        for v in order:
            d = tempfile.mkdtemp(dir=root)
            try:
                results[v].append(run_variant(v, fresh, step, x, steps, d))
            finally:
                shutil.rmtree(d, ignore_errors=True)
    d = tempfile.mkdtemp(dir=root)
    try:
        w = writer_time(fresh, step, x, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)

    def med(v, key):
        return statistics.median(run[key] for run in results[v])

    base = med('none', 'wall') if 'none' in results else None
    d2h = med('d2h', 'block') if 'd2h' in results else None
    print(f"step (no checkpoint): {base / steps * 1e3:.1f} ms; one synchronous durable save: "
          f"{med('save', 'block') * 1e3:.1f} ms; mirror writer per snapshot: {w * 1e3:.1f} ms "
          f"({'keeps up' if base and w < base / steps else 'slower than a step'})"
          if base and 'save' in results else '')
    print(f"{'variant':<9} {'wall (s)':>9} {'x none':>7} {'blocks/call (ms)':>17} {'x d2h':>6} "
          f"{'stalled calls':>14} {'copy when a slot is free (ms)':>30} {'x d2h':>6}")
    for v in variants:
        wall, block = med(v, 'wall'), med(v, 'block')
        ratio = f"{wall / base:.2f}" if base else '-'
        bratio = f"{block / d2h:.2f}" if d2h and v not in ('none', 'd2h') else '-'
        line = f"{v:<9} {wall:>9.3f} {ratio:>7} {block * 1e3:>17.1f} {bratio:>6}"
        if v in ('mirror', 'manager'):
            copies = [run['copy'] for run in results[v] if run['copy'] == run['copy']]
            copy = statistics.median(copies) if copies else float('nan')
            stalled = f"{sum(run['stalls'] for run in results[v])}/{steps * len(results[v])}"
            cratio = f"{copy / d2h:.2f}" if d2h else '-'
            line += f" {stalled:>14} {copy * 1e3:>30.1f} {cratio:>6}"
        print(line)
    for v in ('mirror', 'manager'):
        if v in results:
            print(f"{v} counters after the last run: {results[v][-1]['counters']}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true', help='small sizes, 2 repetitions')
    parser.add_argument('--width', type=int, help='MLP width (one size instead of the default two)')
    parser.add_argument('--depth', type=int, default=4)
    parser.add_argument('--batch', type=int, default=None)
    parser.add_argument('--steps', type=int, default=None)
    parser.add_argument('--reps', type=int, default=None)
    parser.add_argument('--variants', default=','.join(VARIANTS))
    parser.add_argument('--dir', default=None, help='where checkpoints go (default: a temporary folder)')
    args = parser.parse_args(argv)
    variants = tuple(v for v in args.variants.split(',') if v)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    if 'orbax' in variants:
        try:
            import orbax.checkpoint  # noqa: F401
        except ImportError:
            print("orbax-checkpoint is not installed: skipping it (pip install '.[bench]')")
            variants = tuple(v for v in variants if v != 'orbax')
    if args.quick:
        sizes = [(args.width or 512, 128)]
        steps, reps = args.steps or 10, args.reps or 2
    else:
        sizes = [(args.width, args.batch or 256)] if args.width else [(1024, 512), (2048, 64)]
        steps, reps = args.steps or 30, args.reps or 5
    if args.batch is not None:
        sizes = [(w, args.batch) for w, _ in sizes]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} CPUs), "
          f"python {sys.version.split()[0]}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    root = args.dir or tempfile.mkdtemp(prefix='jckpt-bench-')
    os.makedirs(root, exist_ok=True)
    try:
        for width, batch in sizes:
            bench(width, args.depth, batch, steps, reps, variants, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == '__main__':
    main()
