"""Turn benchmark results into ``benchmarks.md`` (tables, targets) and ``img/benchmarks.png``.

>>> fmt_s(0.0123), fmt_bytes(3 * 2**20)
('12.3 ms', '3.0 MiB')
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from typing import Any

from bench.workloads import DESCRIPTIONS

COLUMNS = [('save', 'save, no fsync'), ('durable_save', 'durable save'),
           ('async_block', 'async save blocks'), ('load_host', 'load to host'),
           ('restore', 'restore to jax.Array'), ('first_use', 'load + sum all')]
NOTES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'notes.md')


# ---------------------------------------------------------------------------- formatting

def fmt_s(x: float | None) -> str:
    if x is None:
        return '—'
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    if x < 0.9995:
        return f"{x * 1e3:.3g} ms"
    return f"{x:.3g} s"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return '—'
    for unit, size in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_ratio(x: float | None) -> str:
    if x is None:
        return '—'
    if x < 0.1:
        return f"{x:.2g}x"
    return f"{x:.2f}x" if x < 100 else f"{x:.0f}x"


def stats(runs: list[dict[str, float]], op: str) -> tuple[float, float, float] | None:
    """``(median, min, max)`` of ``op`` over the runs that have it."""
    xs = [r[op] for r in runs if op in r]
    return (statistics.median(xs), min(xs), max(xs)) if xs else None


def median(res: dict[str, Any], tool: str, op: str) -> float | None:
    s = stats(res['runs'].get(tool, []), op)
    return s[0] if s else None


# ---------------------------------------------------------------------------- machine

def _cmd(*args: str) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ''


def machine(base: str) -> dict[str, str]:
    """A description of the machine, the filesystem the files went to, and versions."""
    import importlib.metadata as md
    cpu = ''
    try:
        with open('/proc/cpuinfo') as f:
            cpu = next((ln.split(':', 1)[1].strip() for ln in f if ln.startswith('model name')), '')
    except OSError:
        pass
    mem = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    fs = _cmd('df', '-T', base).splitlines()[-1:] or ['']
    versions = {}
    for pkg in ('jax', 'jaxlib', 'numpy', 'orbax-checkpoint', 'safetensors', 'flax', 'jckpt'):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = 'absent'
    return {'cpu': cpu or platform.processor(), 'cores': str(os.cpu_count()),
            'memory': fmt_bytes(mem), 'os': f"{platform.system()} {platform.release()}",
            'python': platform.python_version(),
            'filesystem': ' '.join(fs[0].split()[1:2]) if fs[0] else '?',
            'versions': ', '.join(f"{k} {v}" for k, v in versions.items())}


# ---------------------------------------------------------------------------- targets

def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(results: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """``(workload, target, measured, met)`` for each stated goal that the run covers."""
    out = []
    W = results['workloads']

    def add(w, text, value, limit, fmt=fmt_ratio, less=True):
        if value is None:
            return
        out.append((w, text, fmt(value), value <= limit if less else value >= limit))

    if 'large' in W:
        r = W['large']
        add('large', 'durable save ≤ 1.1x raw write+fsync',
            _ratio(median(r, 'jckpt', 'durable_save'), median(r, 'raw', 'durable_save')), 1.1)
        add('large', 'load + sum ≤ 1.2x mmap baseline',
            _ratio(median(r, 'jckpt', 'first_use'), median(r, 'mmap', 'first_use')), 1.2)
        add('large', 'load + sum ≤ 1.2x readinto baseline',
            _ratio(median(r, 'jckpt', 'first_use'), median(r, 'raw', 'first_use')), 1.2)
        peers = [median(r, t, 'restore') for t in r['runs'] if t not in ('jckpt', 'raw', 'mmap')]
        peers = [p for p in peers if p is not None]
        if peers:
            add('large', 'restore to jax.Array ≤ fastest peer',
                _ratio(median(r, 'jckpt', 'restore'), min(peers)), 1.0)
    if 'small' in W:
        r = W['small']
        for op, text in (('durable_save', 'durable save'), ('restore', 'restore')):
            add('small', f"{text} ≥ 50x faster than orbax",
                _ratio(median(r, 'orbax', op), median(r, 'jckpt', op)), 50, less=False)
        add('small', 'restore faster than safetensors numpy (ratio < 1)',
            _ratio(median(r, 'jckpt', 'restore'), median(r, 'st-numpy', 'restore')), 1.0)
        add('small', 'load to host faster than safetensors numpy (ratio < 1)',
            _ratio(median(r, 'jckpt', 'load_host'), median(r, 'st-numpy', 'load_host')), 1.0)
        add('small', 'durable save ≤ 1.2x raw write+fsync',
            _ratio(median(r, 'jckpt', 'durable_save'), median(r, 'raw', 'durable_save')), 1.2)
        add('small', 'save without fsync faster than safetensors (ratio < 1)',
            _ratio(median(r, 'jckpt', 'save'), median(r, 'st-numpy', 'save')), 1.0)
    if 'tiny' in W:
        r = W['tiny']
        add('tiny', 'durable save < 2 s', median(r, 'jckpt', 'durable_save'), 2.0, fmt_s)
        add('tiny', 'restore < 2 s', median(r, 'jckpt', 'restore'), 2.0, fmt_s)
        hd = r.get('header_decode')
        if hd:
            add('tiny', 'header decodes < 0.5 s', statistics.median(hd['times']), 0.5, fmt_s)
    for w, r in W.items():
        rss = r.get('rss', {}).get('jckpt', {})
        if 'restore_peak' in rss and r['nbytes'] >= 2**26:
            add(w, 'peak RSS growth of restore + sum ≤ 1.1x the arrays',
                rss['restore_peak'] / rss['nbytes'], 1.1)
    return out


# ---------------------------------------------------------------------------- markdown

def _table(res: dict[str, Any]) -> list[str]:
    tools = list(res['runs'])
    lines = ['| tool | ' + ' | '.join(c for _, c in COLUMNS) + ' | file size | peak RSS: save | '
             'peak RSS: restore + sum |',
             '|---' * (len(COLUMNS) + 4) + '|']
    for t in tools:
        cells = []
        for op, _ in COLUMNS:
            s = stats(res['runs'][t], op)
            if s is None:
                cells.append('—')
            else:
                med, lo, hi = s
                spread = f" ({fmt_s(lo)}-{fmt_s(hi)})" if len(res['runs'][t]) > 1 else ''
                cells.append(fmt_s(med) + spread)
        size = stats(res['runs'][t], 'size')
        rss = res.get('rss', {}).get(t, {})
        n = res['nbytes']
        rs = [f"{fmt_bytes(rss[k])} ({rss[k] / n:.2f}x)" if k in rss else '—'
              for k in ('save_peak', 'restore_peak')]
        name = t + (' †' if t in res.get('notes', {}) else '')
        lines.append(f"| {name} | " + ' | '.join(cells) + f" | {fmt_bytes(size[0] if size else None)} | "
                     + ' | '.join(rs) + ' |')
    return lines


def _ratios(res: dict[str, Any]) -> list[str]:
    ops = [('durable_save', 'durable save'), ('load_host', 'load to host'),
           ('restore', 'restore'), ('first_use', 'load + sum')]
    lines = ['| tool | ' + ' | '.join(f"{c}: vs raw | vs jckpt" for _, c in ops) + ' |',
             '|---' * (1 + 2 * len(ops)) + '|']
    for t in res['runs']:
        cells = []
        for op, _ in ops:
            mine = median(res, t, op)
            cells.append(fmt_ratio(_ratio(mine, median(res, 'raw', op))))
            cells.append(fmt_ratio(_ratio(mine, median(res, 'jckpt', op))))
        lines.append(f"| {t} | " + ' | '.join(cells) + ' |')
    return lines


#: The line of `notes.md` where the run's tables go: the prose before it comes first.
TABLES_MARK = "<!-- the run's tables go here -->"


def _notes() -> tuple[str, str]:
    """`notes.md` before and after `TABLES_MARK` (all of it before, without the mark)."""
    if not os.path.exists(NOTES):
        return '', ''
    with open(NOTES) as f:
        text = f.read()
    before, _, after = text.partition(TABLES_MARK)
    return before.strip(), after.strip()


def write(results: dict[str, Any], out: str) -> str:
    """Write ``out/benchmarks.md`` and ``out/img/benchmarks.png``; return the markdown's path."""
    os.makedirs(os.path.join(out, 'img'), exist_ok=True)
    png = plot(results, os.path.join(out, 'img', 'benchmarks.png'))
    m = results['machine']
    L = ['# Benchmarks', '',
         f"Measured {results['date']} by `nox -s bench` (`python -m bench.run`)"
         + (' in **quick mode** (tiny workloads; not meaningful figures)' if results['quick'] else '')
         + ", every tool run in one process per workload, interleaved, in an order that "
         "rotates each repetition.", '',
         f"**Machine:** {m['cpu']}, {m['cores']} cores, {m['memory']} RAM, {m['os']}, files on "
         f"{m['filesystem']}; Python {m['python']}; {m['versions']}. No accelerator: "
         "`jax.Array`s live on the CPU device.", '']
    before, after = _notes()
    if before:
        L += [before, '']
    L += ['## Targets', '', '| workload | target | measured | met |', '|---|---|---|---|']
    for w, text, value, ok in targets(results):
        L.append(f"| {w} | {text} | {value} | {'yes' if ok else '**no**'} |")
    L += ['', f"![benchmarks](img/{os.path.basename(png)})" if png else '', '']
    for w, res in results['workloads'].items():
        L += [f"## {w}: {DESCRIPTIONS[w]}", '',
              f"{res['leaves']} arrays, {fmt_bytes(res['nbytes'])}; {res['reps']} repetitions. "
              "Times: median (min-max). "
              "Peak RSS: growth of the process's peak resident set during the operation, and "
              "its ratio to the arrays' size.", '']
        L += _table(res)
        L += ['', 'Ratios of medians (below 1 is faster):', '']
        L += _ratios(res)
        notes = res.get('notes', {})
        if notes:
            L += [''] + [f"† {t}: {n}" for t, n in notes.items()]
        hd = res.get('header_decode')
        if hd:
            L += ['', f"jckpt header alone ({fmt_bytes(hd['header_bytes'])}): decodes in "
                      f"{fmt_s(statistics.median(hd['times']))} (median of {len(hd['times'])})."]
        errors = {t: v['error'] for t, v in res.get('rss', {}).items() if 'error' in v}
        for t, e in errors.items():
            L += ['', f"Peak memory of {t} not measured: `{e.strip().splitlines()[-1] if e.strip() else e}`"]
        L.append('')
    if after:
        L += [after, '']
    path = os.path.join(out, 'benchmarks.md')
    with open(path, 'w') as f:
        f.write('\n'.join(L).rstrip() + '\n')
    return path


# ---------------------------------------------------------------------------- plot

def plot(results: dict[str, Any], path: str) -> str | None:
    """Horizontal bars (log scale) of durable save, restore and load + sum per workload."""
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ops = [('durable_save', 'durable save'), ('restore', 'restore to jax.Array'),
           ('first_use', 'load + sum all')]
    W = results['workloads']
    fig, axes = plt.subplots(len(W), len(ops), figsize=(4.2 * len(ops), 0.35 * 9 * len(W) + 1),
                             squeeze=False)
    for row, (w, res) in enumerate(W.items()):
        tools = list(res['runs'])
        for col, (op, title) in enumerate(ops):
            ax = axes[row][col]
            meds, errs, names, colors = [], [[], []], [], []
            for t in tools:
                s = stats(res['runs'][t], op)
                if s is None:
                    continue
                names.append(t)
                meds.append(s[0])
                errs[0].append(s[0] - s[1])
                errs[1].append(s[2] - s[0])
                colors.append('#d62728' if t == 'jckpt' else '#7f7f7f' if t in ('raw', 'mmap')
                              else '#1f77b4')
            y = range(len(names))
            ax.barh(y, meds, xerr=errs, color=colors, capsize=2)
            ax.set_yticks(list(y), names, fontsize=8)
            ax.invert_yaxis()
            ax.set_xscale('log')
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.tick_params(axis='x', labelsize=8)
            ax.set_title(f"{w}: {title} (s)", fontsize=9)
    fig.suptitle(f"jckpt vs peers, {results['date']}, {results['machine']['cores']} cores "
                 "(lower is better; bars: median, whiskers: min-max)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
