"""Checkpoints on an accelerator, in one run: restore onto the device, the copy limits, and how
long asynchronous checkpoints block a training loop.

Run on a machine with a GPU (`python -m bench.gpu`, or `bench/gpu_run.sh` for the tests too);
on the CPU it runs as well, and `--quick` makes it take a minute or so. Everything runs on
JAX's default device. Prints Markdown tables and writes one JSON object (`--json`):

* **limits**: the same bytes as the large state copied host-to-device (`jax.device_put`),
  device-to-host (to numpy, and into `pinned_host` memory where the device has it),
  device-to-device (`device_put(..., may_alias=False)` and a jitted copy), and a host memcpy.
* **restore**: a random float32 state (1 GiB; `--gib 1,4` for more sizes) and 2,000 small
  arrays restored onto the device by jckpt, orbax (`StandardCheckpointer.restore` with
  device targets), `safetensors.flax.load_file`, and a raw `readinto` + `jax.device_put`.
  The files are in the page cache (each was just written): these are memory-speed reads.
* **blocking** (`mirror_blocking`): a fake training step (a jitted matmul loop, ~60 ms) on a
  random state, a checkpoint every 20 steps through `jckpt.Mirror.submit`,
  `jckpt.CheckpointManager.save` and orbax's asynchronous `CheckpointManager.save`: the time
  each call blocks, and the whole loop's wall time against the same loop with no checkpoint.
  `mirror-host` takes no device image (a copy to host at submit, as when the device has no
  room for one); the `-plain` variants move device data into fresh host buffers instead of
  pinned ones (`jckpt.trees.transfers.SNAPSHOT_MEMORY`), to measure which is faster.

```console
$ python -m bench.gpu --quick --json /tmp/gpu.json   # doctest: +SKIP
```
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench import tools as bt

MIB = 1 << 20
RESTORE_TOOLS = ('jckpt', 'orbax', 'st-flax', 'raw')


# --------------------------------------------------------------------------- timing


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes, waiting for every array it returns."""
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    del out
    return seconds


def _stats(seconds: list[float], nbytes: int) -> dict[str, float]:
    """Median, min and max in milliseconds, and the median's rate in GB/s."""
    med = statistics.median(seconds)
    return {'ms': med * 1e3, 'min_ms': min(seconds) * 1e3, 'max_ms': max(seconds) * 1e3,
            'gbps': nbytes / med / 1e9 if med > 0 else float('inf')}


def _repeat(fn: Callable[[], Any], reps: int, nbytes: int, prepare: Callable[[], Any] | None = None):
    """``_stats`` of ``reps`` timed calls; ``prepare()`` (untimed) gives each call its input."""
    times = []
    for _ in range(reps):
        call = fn
        if prepare is not None:
            call = functools.partial(fn, jax.block_until_ready(prepare()))
        times.append(_timed(call))
    return _stats(times, nbytes)


def random_state(nbytes: int, leaves: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """``leaves`` random float32 host arrays of ``nbytes`` in all (incompressible, unlike zeros)."""
    rng = np.random.default_rng(seed)
    per = max(1, nbytes // 4 // leaves)
    return {f'w{i}': rng.random(per, dtype=np.float32) for i in range(leaves)}


def small_state(count: int, elements: int = 1000, seed: int = 1) -> dict[str, np.ndarray]:
    """``count`` random float32 arrays of ``elements`` each (an optimizer's many small leaves)."""
    rng = np.random.default_rng(seed)
    return {f's{i:04d}': rng.random(elements, dtype=np.float32) for i in range(count)}


# --------------------------------------------------------------------------- limits


def limits(nbytes: int, device: jax.Device, reps: int) -> dict[str, dict[str, float] | None]:
    """The copies a checkpoint cannot beat, of ``nbytes`` random bytes, on ``device``."""
    host = random_state(nbytes, leaves=1)['w0']
    on_device = jax.device_put(host, device)
    warm = np.ones_like(host)  # every page touched once, as a reused slot buffer is
    fresh = jax.jit(lambda a: a + 0)  # a new device array each time (a read caches its host copy)
    to_numpy = np.array if device.platform == 'cpu' else np.asarray  # one copy on either
    out: dict[str, dict[str, float] | None] = {
        'host memcpy (warm buffer)': _repeat(lambda: np.copyto(warm, host), reps, host.nbytes),
        'host-to-device': _repeat(lambda: jax.device_put(host, device), reps, host.nbytes),
        'device-to-host (numpy)': _repeat(to_numpy, reps, host.nbytes,
                                          prepare=lambda: fresh(on_device)),
        'device-to-device (device_put copy)': _repeat(
            lambda: jax.device_put(on_device, device, may_alias=False), reps, host.nbytes),
        'device-to-device (jitted copy)': _repeat(
            lambda: _copy(on_device), reps, host.nbytes),
        'device-to-host (pinned_host)': None,
        'device-to-host (pinned_host, as numpy)': None,
    }
    kinds = {m.kind for m in device.addressable_memories()}
    if 'pinned_host' in kinds:
        pinned = jax.sharding.SingleDeviceSharding(device, memory_kind='pinned_host')
        jax.block_until_ready(jax.device_put(on_device, pinned))  # warm the path
        out['device-to-host (pinned_host)'] = _repeat(
            lambda x: jax.device_put(x, pinned), reps, host.nbytes, prepare=lambda: fresh(on_device))
        # the same, read by numpy as a snapshot's drain reads it (no more if numpy views it)
        out['device-to-host (pinned_host, as numpy)'] = _repeat(
            lambda x: np.asarray(jax.device_put(x, pinned)), reps, host.nbytes,
            prepare=lambda: fresh(on_device))
    return out


@jax.jit
def _copy(a: jax.Array) -> jax.Array:
    return jnp.copy(a)


# --------------------------------------------------------------------------- restore


def _spec(tree: dict[str, np.ndarray], device: jax.Device) -> dict[str, jax.ShapeDtypeStruct]:
    sharding = jax.sharding.SingleDeviceSharding(device)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in tree.items()}


def restore_one(name: str, tree: dict, device: jax.Device, reps: int, directory: str) -> dict:
    """Save ``tree`` with tool ``name``, then time its restores onto ``device``: the first, and
    the ``_stats`` of the next ``reps``."""
    tool = bt.TOOLS[name]()
    path = tool.path(directory)
    nbytes = sum(v.nbytes for v in tree.values())
    spec = _spec(tree, device)
    try:
        tool.save(jax.device_put(tree, device), path, durable=False)
        first = _timed(lambda: tool.restore(path, spec))
        back = tool.restore(path, spec)
        got = jax.tree.leaves(back)
        assert all(a.devices() == {device} for a in got), (name, [a.devices() for a in got[:2]])
        assert all(np.array_equal(np.asarray(a), b) for a, b in zip(got, jax.tree.leaves(tree))), name
        del back, got
        out = _repeat(lambda: tool.restore(path, spec), reps, nbytes)
        return {'first_ms': first * 1e3, **out}
    finally:
        tool.close()
        bt.remove(path)


def restores(states: dict[str, dict], device: jax.Device, reps: int, directory: str) -> dict:
    """``{state: {tool: timings or {'error': ...}}}`` for every available restore tool."""
    out: dict[str, dict] = {}
    for label, tree in states.items():
        out[label] = {}
        for name in RESTORE_TOOLS:
            if not bt.TOOLS[name].available():
                out[label][name] = {'error': 'not installed'}
                continue
            try:
                out[label][name] = restore_one(name, tree, device, reps, directory)
            except Exception as e:  # a peer's failure is a result, not the end of the run
                out[label][name] = {'error': f'{type(e).__name__}: {e}'[:300]}
            print(f'  restore {label} {name}: {_brief(out[label][name])}', flush=True)
    return out


def _brief(r: dict) -> str:
    if 'error' in r:
        return r['error']
    return f"{r['ms']:.1f} ms ({r['gbps']:.2f} GB/s), first {r['first_ms']:.1f} ms"


# --------------------------------------------------------------------------- blocking


def make_step(device: jax.Device, target_ms: float, n: int) -> tuple[Callable, jax.Array, float]:
    """A fake training step: a jitted loop of ``n`` x ``n`` matmuls sized to take about
    ``target_ms``, which also writes every leaf of the state (as an optimizer update does).
    Returns ``(step, w, measured ms)``; ``step(state, w)`` gives the next state."""
    w = jax.device_put(np.random.default_rng(2).standard_normal((n, n), np.float32) / np.sqrt(n),
                       device)

    def build(iters: int) -> Callable:
        @functools.partial(jax.jit, donate_argnums=0)  # as a training step donates its state
        def step(state, w):
            a = jax.lax.fori_loop(0, iters, lambda i, a: jnp.tanh(a @ w), w)
            return jax.tree.map(lambda s: s + a[0, 0] * 1e-7, state)
        return step

    def timed(fn: Callable) -> float:
        return min(_timed(lambda: fn(fresh(), w)) for _ in range(3))

    def fresh() -> dict:
        return {'x': jnp.zeros(8, jnp.float32, device=device)}

    probe = build(4)
    jax.block_until_ready(probe(fresh(), w))
    step = build(max(1, round(target_ms / 1e3 / (timed(probe) / 4))))
    jax.block_until_ready(step(fresh(), w))
    return step, w, timed(step) * 1e3


def _sink(variant: str, directory: str) -> tuple[Callable, Callable, Callable, Any]:
    """``(save(step, state), drain(), close(), the writer)`` of one checkpointing variant."""
    import jckpt
    if variant == 'none':
        return (lambda i, s: None), (lambda: None), (lambda: None), None
    if variant.startswith('mirror'):
        # mirror-host: no device image, a copy to host at submit; -plain: into fresh host
        # buffers instead of the pinned ones the runtime reuses (transfers.SNAPSHOT_MEMORY)
        from jckpt.trees import transfers
        kept = transfers.SNAPSHOT_MEMORY
        transfers.SNAPSHOT_MEMORY = None if variant.endswith('-plain') else kept
        m = jckpt.Mirror(os.path.join(directory, 'mirror.jckpt'), new_lineage=True,
                         device_image_bytes=0 if variant.startswith('mirror-host') else None)

        def close() -> None:
            try:
                m.close()
            finally:
                transfers.SNAPSHOT_MEMORY = kept
        return (lambda i, s: m.submit(s)), m.wait_durable, close, m
    if variant == 'manager':
        mgr = jckpt.CheckpointManager(os.path.join(directory, 'manager'), keep_last=2)
        return (lambda i, s: mgr.save(i, s)), mgr.wait_durable, mgr.close, mgr
    import orbax.checkpoint as ocp
    om = ocp.CheckpointManager(os.path.join(directory, 'orbax'), options=ocp.CheckpointManagerOptions(
        max_to_keep=2, enable_async_checkpointing=True))
    return (lambda i, s: om.save(i, args=ocp.args.StandardSave(s))), om.wait_until_finished, om.close, om


def training_loop(variant: str, state: Any, step: Callable, w: jax.Array, steps: int, every: int,
                  directory: str) -> dict:
    """``steps`` steps, a checkpoint through ``variant`` every ``every``: the seconds each
    checkpoint call blocked, the loop's wall time (up to the last step's result), and the
    drain after it. The state is ready before each call (so its time is the checkpoint's own),
    in the loop without checkpoints too. Each step donates the state it is given, so the loop
    runs on a copy of `state`, and a checkpoint must survive that donation."""
    state = jax.block_until_ready(jax.tree.map(jnp.copy, state))
    save, drain, close, writer = _sink(variant, directory)
    blocks = []
    try:
        start = time.perf_counter()
        for i in range(1, steps + 1):
            state = step(state, w)
            if i % every == 0:
                jax.block_until_ready(state)
                t0 = time.perf_counter()
                save(i, state)
                blocks.append(time.perf_counter() - t0)
        jax.block_until_ready(state)
        wall = time.perf_counter() - start
        t0 = time.perf_counter()
        drain()
        out = {'wall_s': wall, 'drain_s': time.perf_counter() - t0}
        if variant != 'none':
            out.update(blocks_ms=[b * 1e3 for b in blocks], first_ms=blocks[0] * 1e3,
                       block_ms=statistics.median(blocks[1:] or blocks) * 1e3)
        if hasattr(writer, 'counters'):
            counters = writer.counters
            out['counters'] = str(counters)
            out['path'] = ('device image' if counters.images == len(blocks)
                           else 'host copy' if counters.images == 0 else 'mixed')
        return out
    finally:
        close()


def mirror_blocking(nbytes: int, device: jax.Device, *, step_ms: float, steps: int = 60,
                    every: int = 20, n: int = 2048, directory: str,
                    variants: tuple[str, ...] = ('none', 'mirror', 'mirror-plain', 'mirror-host',
                                                 'mirror-host-plain', 'manager', 'orbax',
                                                 'none')) -> dict:
    """Blocking per checkpoint and whole-loop overhead of asynchronous checkpoints of a random
    float32 state of ``nbytes`` on ``device``, checkpointed every ``every`` of ``steps`` steps
    of about ``step_ms`` each; ``{'step_ms': ..., 'runs': {variant: training_loop(...)}}``
    with each run's overhead against the loop with no checkpoint ('none' runs first and last,
    and its faster run counts, so a drift of the machine shows as a spread, not a bias)."""
    step, w, _ = make_step(device, step_ms, n)
    state = jax.device_put(random_state(nbytes), device)
    copies = [jax.tree.map(jnp.copy, state) for _ in range(4)]
    jax.block_until_ready(step(copies.pop(), w))  # compiled for this state, outside the timing
    measured = min(_timed(lambda: step(copies.pop(), w)) for _ in range(3)) * 1e3
    runs: dict[str, dict] = {}
    for variant in variants:
        if variant == 'orbax' and not bt.TOOLS['orbax'].available():
            runs[variant] = {'error': 'not installed'}
            continue
        sub = tempfile.mkdtemp(prefix=f'{variant}-', dir=directory)
        try:
            run = training_loop(variant, state, step, w, steps, every, sub)
        except Exception as e:
            run = {'error': f'{type(e).__name__}: {e}'[:300]}
        finally:
            shutil.rmtree(sub, ignore_errors=True)
        print(f"  loop {variant}: {run}", flush=True)
        if variant in runs and 'wall_s' in runs[variant]:  # the baseline again
            run = dict(run, walls_s=[runs[variant]['wall_s'], run['wall_s']],
                       wall_s=min(runs[variant]['wall_s'], run['wall_s']))
        runs[variant] = run
    base = runs.get('none', {}).get('wall_s')
    for r in runs.values():
        if base and 'wall_s' in r:
            r['overhead'] = r['wall_s'] / base - 1
    return {'step_ms': measured, 'steps': steps, 'every': every, 'bytes': nbytes, 'runs': runs}


# --------------------------------------------------------------------------- report


def machine(device: jax.Device) -> dict[str, Any]:
    """What the figures were measured on."""
    return {'date': datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC'),
            'platform': device.platform, 'device': getattr(device, 'device_kind', str(device)),
            'devices': jax.device_count(), 'jax': jax.__version__, 'python': platform.python_version(),
            'cpus': os.cpu_count(), 'host': platform.platform()}


def markdown(result: dict) -> str:
    """The result as Markdown tables (what a GPU section of docs/benchmarks.md shows)."""
    m = result['machine']
    lines = [f"Measured {m['date']} on {m['device']} ({m['platform']}, {m['devices']} device(s)), "
             f"jax {m['jax']}, {m['cpus']} CPUs.", '', '| copy | ms | GB/s |', '|---|---|---|']
    for name, r in result['limits'].items():
        lines.append(f'| {name} | ' + ('n/a | n/a |' if r is None else f"{r['ms']:.1f} | {r['gbps']:.2f} |"))
    tools = RESTORE_TOOLS
    lines += ['', '| restore onto the device | ' + ' | '.join(tools) + ' |', '|---' * (len(tools) + 1) + '|']
    for label, row in result['restore'].items():
        cells = [row[t].get('error', '')[:40] if 'error' in row[t] else
                 f"{row[t]['ms']:.1f} ms ({row[t]['first_ms']:.0f} first)" for t in tools]
        lines.append(f'| {label} | ' + ' | '.join(cells) + ' |')
    b = result['blocking']
    lines += ['', f"Training loop: {b['steps']} steps of {b['step_ms']:.0f} ms, a checkpoint every "
              f"{b['every']}, state {b['bytes'] / MIB:.0f} MiB random float32.", '',
              '| | blocked per checkpoint (median; first) | snapshot | loop | overhead | drain after |',
              '|---|---|---|---|---|---|']
    for name, r in b['runs'].items():
        if 'error' in r:
            lines.append(f"| {name} | {r['error'][:60]} | | | | |")
            continue
        block = f"{r['block_ms']:.1f} ms; {r['first_ms']:.1f} ms" if 'block_ms' in r else '-'
        lines.append(f"| {name} | {block} | {r.get('path', '-')} | {r['wall_s']:.2f} s | "
                     f"{r.get('overhead', 0):+.1%} | {r['drain_s']:.2f} s |")
    return '\n'.join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--quick', action='store_true', help='64 MiB, 500 small arrays, short steps')
    ap.add_argument('--gib', default='1', help='large state sizes in GiB, comma-separated (1,4)')
    ap.add_argument('--small', type=int, default=None, help='how many small arrays (2000)')
    ap.add_argument('--reps', type=int, default=None, help='timed repetitions (5; quick 2)')
    ap.add_argument('--skip', default='', help='sections to leave out: limits,restore,blocking')
    ap.add_argument('--steps', type=int, default=None, help='training steps of the blocking loop (60)')
    ap.add_argument('--every', type=int, default=None, help='a checkpoint every this many steps (20)')
    ap.add_argument('--json', default=None, help='write the result there')
    ap.add_argument('--dir', default=None, help='where to write files (a temporary directory)')
    args = ap.parse_args(argv)
    device = jax.devices()[0]
    reps = args.reps or (2 if args.quick else 5)
    sizes = [64 * MIB] if args.quick else [int(float(g) * 1024) * MIB for g in args.gib.split(',')]
    small = args.small or (500 if args.quick else 2000)
    skip = set(filter(None, args.skip.split(',')))
    directory = tempfile.mkdtemp(prefix='bench-gpu-', dir=args.dir)
    result: dict[str, Any] = {'machine': machine(device), 'limits': {}, 'restore': {},
                              'blocking': {'steps': 0, 'every': 0, 'step_ms': 0, 'bytes': 0, 'runs': {}}}
    print(f"{result['machine']}; files in {directory}", flush=True)
    try:
        if 'limits' not in skip:
            result['limits'] = limits(sizes[0], device, reps)
        if 'restore' not in skip:
            states = {f'{n / MIB:.0f} MiB random': random_state(n) for n in sizes}
            states[f'{small} small arrays'] = small_state(small)
            result['restore'] = restores(states, device, reps, directory)
        if 'blocking' not in skip:
            loop = dict(step_ms=10, steps=12, every=4, n=256) if args.quick else dict(step_ms=60, n=2048)
            loop.update({k: getattr(args, k) for k in ('steps', 'every') if getattr(args, k)})
            result['blocking'] = mirror_blocking(sizes[0], device, directory=directory, **loop)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(markdown(result))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == '__main__':
    main()
