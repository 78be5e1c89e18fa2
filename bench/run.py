"""Run the comparison: every tool on every workload, interleaved, several repetitions.

    python -m bench.run                      # the full suite, writes docs/benchmarks.md
    python -m bench.run --quick --out /tmp/q # small workloads, one repetition (CI)
    python -m bench.run --workloads small,tiny --tools jckpt,orbax --reps 3

Within one workload every tool runs in the same process, one after another
in an order that rotates each repetition, so a slow spell of the machine
lands on every tool alike. Each operation's median and spread (min-max) are
reported, with ratios against the raw-file baseline and against jckpt. Peak
memory is measured per tool and workload in a fresh subprocess (peak resident
set reset just before the operation, read from ``/proc/self/status``).
Files are deleted as soon as a tool's turn ends.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax
import numpy as np

from bench import report, workloads
from bench.tools import TOOLS, Tool, disk_size, remove

OPS = ('save', 'durable_save', 'async_block', 'load_host', 'restore', 'first_use')
#: A tool whose first repetition of a workload takes longer than this (seconds, all
#: operations together) gets no further repetitions of it; the report says so.
SLOW_REP_S = 60.0


# ---------------------------------------------------------------------------- measuring

def spec_of(tree: Any) -> Any:
    """The abstract tree (shapes, dtypes, shardings) a restore is asked for."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def to_device(host_tree: Any) -> Any:
    """The workload as ``jax.Array``s on the default device (one batched transfer)."""
    leaves, treedef = jax.tree.flatten(host_tree)
    arrays = jax.device_put(leaves, jax.devices()[0])
    jax.block_until_ready(arrays)
    return jax.tree.unflatten(treedef, arrays)


def touch_all(arrays: list[Any]) -> float:
    """Sum every array (on the host): what a first use of the loaded values costs."""
    total = 0.0
    for a in arrays:
        a = np.asarray(a)
        total += float(a.sum(dtype=np.float32) if a.dtype.kind in 'fV' else a.sum())
    return total


def host_arrays(tool: Tool, path: str, spec: Any) -> list[Any]:
    arrays = tool.load_host(path, spec)
    return arrays if arrays is not None else jax.tree.leaves(tool.restore(path, spec))


def clock(fn, *args) -> tuple[float, Any]:
    """Seconds `fn(*args)` takes (after a garbage collection), and what it returns."""
    gc.collect()
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def one_round(tool: Tool, tree: Any, spec: Any, path: str) -> dict[str, float]:
    """Every operation of ``tool`` once; returns seconds per operation and the file size."""
    rec: dict[str, float] = {}
    remove(path)
    if tool.timed_save:
        rec['save'] = clock(tool.save, tree, path, False)[0]
        remove(path)
        rec['durable_save'] = clock(tool.save, tree, path, True)[0]
    else:
        tool.save(tree, path, False)
    if tool.has_async:
        remove(path)
        tool.open_async(path)
        blocking, wait = clock(tool.save_async, tree, path)
        wait()
        rec['async_block'] = blocking
    rec['size'] = disk_size(path)
    t, arrays = clock(tool.load_host, path, spec)
    if arrays is not None:
        rec['load_host'] = t
    del arrays

    def restore():
        out = tool.restore(path, spec)
        jax.block_until_ready(out)
        return out
    rec['restore'] = clock(restore)[0]
    rec['first_use'] = clock(lambda: touch_all(host_arrays(tool, path, spec)))[0]
    remove(path)
    return rec


def time_workload(name: str, tool_names: list[str], reps: int, quick: bool, base: str,
                  log) -> dict[str, Any]:
    """Interleaved repetitions of every tool on workload ``name``."""
    host = workloads.build(name, quick)
    tree = to_device(host)
    del host
    spec = spec_of(tree)
    leaves = jax.tree.leaves(tree)
    nbytes = int(sum(a.nbytes for a in leaves))
    skipped = {t: why for t, why in workloads.SKIP.get(name, {}).items() if t in tool_names}
    skipped.update({t: 'not installed' for t in tool_names if not TOOLS[t].available()})
    tool_names = [t for t in tool_names if t not in skipped]
    tools = {t: TOOLS[t]() for t in tool_names}
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in tool_names}
    capped: dict[str, str] = {}
    try:
        for rep in range(reps):
            order = tool_names[rep % len(tool_names):] + tool_names[:rep % len(tool_names)]
            for t in order:
                if t in capped:
                    continue
                started = time.perf_counter()
                try:
                    runs[t].append(one_round(tools[t], tree, spec, tools[t].path(base)))
                except Exception as e:  # a peer that cannot handle a workload is reported as such
                    capped[t] = f"failed: {type(e).__name__}: {str(e)[:160]}"
                    remove(tools[t].path(base))
                    log(f"  {name}/{t}: {capped[t]}")
                    continue
                spent = time.perf_counter() - started
                log(f"  {name} rep {rep + 1}/{reps} {t}: "
                    + ', '.join(f"{k} {v:.4g}" for k, v in runs[t][-1].items()))
                if rep == 0 and reps > 1 and spent > SLOW_REP_S:
                    capped[t] = f"one repetition only ({spent:.0f} s per repetition)"
    finally:
        for tool in tools.values():
            tool.close()
    return {'nbytes': nbytes, 'leaves': len(leaves), 'runs': runs, 'notes': {**capped, **skipped}}


def header_decode(name: str, quick: bool, base: str, reps: int) -> dict[str, float] | None:
    """Seconds to read and decode the header of the workload's jckpt file alone."""
    import jckpt
    from jckpt.format.header import decode_header
    tree = workloads.build(name, quick)
    path = os.path.join(base, 'header.jckpt')
    jckpt.save(jckpt.Context(durable=False), tree, path)
    with open(path, 'rb') as f:
        first = f.read(4)
        raw = first + f.read(int.from_bytes(first, 'big'))
    times = [clock(decode_header, raw)[0] for _ in range(reps)]
    remove(path)
    return {'header_bytes': len(raw), 'times': times}


# ---------------------------------------------------------------------------- peak memory

def _rss_now() -> int:
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


def _rss_peak() -> int:
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmHWM:'):
                return int(line.split()[1]) * 1024
    raise RuntimeError('no VmHWM')


def _reset_peak() -> None:
    gc.collect()
    with open('/proc/self/clear_refs', 'w') as f:  # "5" resets the peak RSS (Linux >= 4.0)
        f.write('5')


def rss_child(name: str, tool_name: str, quick: bool, base: str) -> dict[str, Any]:
    """In a fresh process: peak RSS growth of a durable save, and of a restore plus a sum."""
    tool = TOOLS[tool_name]()
    host = workloads.build(name, quick)
    tree = to_device(host)
    del host
    spec = spec_of(tree)
    nbytes = int(sum(a.nbytes for a in jax.tree.leaves(tree)))
    path = tool.path(base)
    remove(path)
    out: dict[str, Any] = {'nbytes': nbytes}
    _reset_peak()
    before = _rss_now()
    tool.save(tree, path, True)
    out['save_peak'] = _rss_peak() - before
    del tree
    tool.close()
    tool = TOOLS[tool_name]()
    _reset_peak()
    before = _rss_now()
    restored = tool.restore(path, spec)
    jax.block_until_ready(restored)
    touch_all(jax.tree.leaves(restored))
    out['restore_peak'] = _rss_peak() - before
    del restored
    tool.close()
    remove(path)
    return out


def measure_rss(name: str, tool_names: list[str], quick: bool, base: str, log) -> dict[str, Any]:
    out = {}
    for t in tool_names:
        if t == 'mmap':
            continue  # shares the raw file's writer; its restore is the raw one's with a mapping
        cmd = [sys.executable, '-m', 'bench.run', '--rss-child', name, t, '--dir', base]
        if quick:
            cmd.append('--quick')
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            line = [ln for ln in res.stdout.splitlines() if ln.startswith('{')]
            if res.returncode or not line:
                out[t] = {'error': (res.stderr or res.stdout)[-300:]}
            else:
                out[t] = json.loads(line[-1])
        except subprocess.TimeoutExpired:
            out[t] = {'error': 'timed out'}
        log(f"  rss {name}/{t}: {out[t]}")
    return out


# ---------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--quick', action='store_true', help='small workloads, one repetition')
    ap.add_argument('--workloads', default=','.join(workloads.WORKLOADS))
    ap.add_argument('--tools', default=','.join(TOOLS))
    ap.add_argument('--reps', type=int, default=None,
                    help='repetitions (default: 3 for the 1 GiB workloads, 5 or 3 for the others; quick 1)')
    ap.add_argument('--dir', default=None, help='where the files go (default: a temp dir)')
    ap.add_argument('--out', default='docs', help='folder for benchmarks.md and img/')
    ap.add_argument('--no-rss', action='store_true', help='skip the peak-memory subprocesses')
    ap.add_argument('--json', default=None, help='also write the raw results here')
    ap.add_argument('--from-json', default=None, help='only rewrite the report from saved results')
    ap.add_argument('--rss-child', nargs=2, metavar=('WORKLOAD', 'TOOL'), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.from_json:
        with open(args.from_json) as f:
            print(f"wrote {report.write(json.load(f), args.out)}")
        return 0

    if args.rss_child:
        print(json.dumps(rss_child(*args.rss_child, args.quick, args.dir)))
        return 0

    names = [w for w in args.workloads.split(',') if w]
    tool_names = [t for t in args.tools.split(',') if t]
    for w in names:
        if w not in workloads.WORKLOADS:
            ap.error(f"unknown workload {w!r}; choose from {sorted(workloads.WORKLOADS)}")
    for t in tool_names:
        if t not in TOOLS:
            ap.error(f"unknown tool {t!r}; choose from {sorted(TOOLS)}")

    def log(msg: str) -> None:
        print(msg, flush=True)

    own_dir = args.dir is None
    base = tempfile.mkdtemp(prefix='jckpt-bench-') if own_dir else args.dir
    os.makedirs(base, exist_ok=True)
    results: dict[str, Any] = {'machine': report.machine(base), 'quick': args.quick,
                               'date': datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC'),
                               'workloads': {}}
    try:
        for w in names:
            log(f"workload {w}: {workloads.DESCRIPTIONS[w]}")
            reps = args.reps or (1 if args.quick else workloads.REPS[w])
            res = time_workload(w, tool_names, reps, args.quick, base, log)
            if 'jckpt' in tool_names:
                res['header_decode'] = header_decode(w, args.quick, base, max(3, reps))
            if not args.no_rss:  # quick mode: only check that the measurement works
                rss_tools = [t for t in res['runs'] if not args.quick or t in ('jckpt', 'raw')]
                res['rss'] = measure_rss(w, rss_tools, args.quick, base, log)
            res['reps'] = reps
            results['workloads'][w] = res
            gc.collect()
    finally:
        if own_dir:
            remove(base)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=1)
    md = report.write(results, args.out)
    log(f"wrote {md}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
