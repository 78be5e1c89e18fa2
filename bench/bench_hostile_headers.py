"""What refusing a crafted header costs, beside what reading a legitimate one of its size costs.

    python bench/bench_hostile_headers.py                 # 10, 20 and 40 MB
    python bench/bench_hostile_headers.py --sizes 10      # some of them

Crafted headers (what the hostile fuzzer's `amplify` mutator writes, at a chosen size):
one list item of a small valid header repeated until the header is that large, spaced with
line breaks so that jckpt's fast entry decoder does not take it, its header checksum made
right as a crafted file's author would:

* ``field``: an entry's `(offset 32)` (a field twice);
* ``path``: a path component `(k w)` (a key path far deeper than any);
* ``entry``: a whole OCANNL entry (namespace `""`, off jckpt's layout: a duplicate identity);
* ``metadata``: a metadata pair;
* ``index``: an array's `(id 0)` in a directory index, outside its pieces.

Legitimate headers of the same sizes: ``jckpt``, a file of small entries as jckpt writes
them (100,000 of them make 20 MB); ``ocannl``, entries as OCANNL writes them (namespace
`""`, no path: the general reader's work). Each is decoded (`decode_header`, and the
index read by `parse_index`) in a child forked for it; the table gives its seconds and
how much its peak RSS grew (MiB), and what it answered.

    python bench/bench_hostile_headers.py --legit 200000   # a legitimate header, in process

gives instead the median seconds of decoding a legitimate file header of that many entries
in this process (`--repeat` runs): run it on two builds to compare what a change to the
reader costs legitimate headers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import struct
import time

from jckpt.errors import FormatError
from jckpt.format.header import Entry, Header, decode_header, encode_header
from jckpt.format.header_seal import seal_header
from jckpt.format.index import IndexedArray, index_header, parse_index


def _entry(i: int, namespace: str = 'jckpt', path: bool = True) -> Entry:
    return Entry(id=i, namespace=namespace, label=(f'w{i}',), prec='Single_prec', dims=(2,),
                 offset=8 * i, byte_length=8, path=(('k', f'w{i}'),) if path else None,
                 checksum=('xxh3_64', '0123456789abcdef') if path else None)


def _text(h: Header) -> str:
    raw = encode_header(h)
    return raw[4:4 + struct.unpack('>I', raw[:4])[0]].decode()


def _index() -> str:
    e = Entry(id=0, namespace='jckpt', prec='Single_prec', dims=(4,), offset=0, byte_length=16,
              label=('w',), path=(('k', 'w'),))
    arrays = [IndexedArray(e, ((0, ((0, 2),)), (1, ((2, 4),))))]
    return _text(index_header(['process_00000.jckpt', 'process_00001.jckpt'], 2, arrays, 32,
                              {}, writer='jckpt'))


def _amplified(text: str, item: str, size: int) -> str:
    at = text.index(item)
    depth = 0
    for end in range(at, len(text)):
        depth += {'(': 1, ')': -1}.get(text[end], 0)
        if depth == 0:
            break
    unit = '\n' + text[at:end + 1]
    return text[:end + 1] + unit * max(1, (size - len(text)) // len(unit)) + text[end + 1:]


def _legit(kind: str, size: int) -> str:
    args = ('', False) if kind == 'ocannl' else ()
    one = len(_text(Header(tensors=(_entry(10**5, *args), _entry(10**5 + 1, *args))))) - \
        len(_text(Header(tensors=(_entry(10**5, *args),))))
    count = size // one
    return _text(Header(tensors=tuple(_entry(i, *args) for i in range(count))))


def headers(size: int) -> dict[str, str]:
    """Every header of the run at `size` bytes, by name."""
    small = _text(Header(tensors=(_entry(0), _entry(1)), metadata=(('note', 'x'),), writer='w'))
    ocannl = _text(Header(tensors=(_entry(0, '', False), _entry(1, '', False))))
    return {'field': _amplified(small.replace('(offset 8)', '(offset 32)'), '(offset 32)', size),
            'path': _amplified(small, '(k w0)', size),
            'entry': _amplified(ocannl, '((id 1)', size),
            'metadata': _amplified(small, '(note x)', size),
            'index': _amplified(_index(), '(id 0)', size),
            'jckpt': _legit('jckpt', size), 'ocannl': _legit('ocannl', size)}


def _hwm_kib() -> int:
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith('VmHWM:'))


def _measure(name: str, raw: bytes) -> dict:
    """Decode `raw` in a forked child: seconds, peak RSS growth, the answer."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        start, t = _hwm_kib(), time.perf_counter()
        try:
            h = decode_header(raw, file=name)
            if name == 'index':
                parse_index(h, name)
            answer = f"read, {len(h.tensors)} entries"
        except FormatError as e:
            answer = 'refused: ' + str(e).split(' (fix:')[0].split(': ', 1)[-1][:70]
        out = {'s': time.perf_counter() - t, 'mib': (_hwm_kib() - start) / 1024, 'answer': answer}
        os.write(wfd, json.dumps(out).encode())
        os._exit(0)
    os.close(wfd)
    os.waitpid(pid, 0)
    with os.fdopen(rfd) as f:
        return json.loads(f.read())


def legit_median_s(entries: int, repeat: int) -> float:
    """Median seconds of `decode_header` of a file header of `entries` entries as jckpt
    writes them, run `repeat` times in this process."""
    raw = encode_header(Header(tensors=tuple(_entry(i) for i in range(entries))))
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        decode_header(raw)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--sizes', default='10,20,40', help='header sizes in MB, comma-separated')
    p.add_argument('--repeat', type=int, default=3, help='runs of each (the median is shown)')
    p.add_argument('--legit', type=int, help='entries of a legitimate header to time instead')
    args = p.parse_args(argv)
    if args.legit:
        print(f"legitimate header of {args.legit} entries: "
              f"{legit_median_s(args.legit, args.repeat):.3f} s (median of {args.repeat})")
        return
    print('| header | MB | seconds | peak RSS growth (MiB) | answer |\n|---|---|---|---|---|')
    for mb in [int(s) for s in args.sizes.split(',')]:
        for name, text in headers(mb * 10**6).items():
            body = text.encode()
            raw = seal_header(struct.pack('>I', len(body)) + body)  # as a crafted file's author
            runs = sorted((_measure(name, raw) for _ in range(args.repeat)), key=lambda r: r['s'])
            mid = runs[len(runs) // 2]
            answer = re.sub(r'\d{4,}', 'N', mid['answer'])
            print(f"| {name} | {len(raw) / 1e6:.0f} | {mid['s']:.2f} | {mid['mib']:.0f} | "
                  f"{answer} |", flush=True)


if __name__ == '__main__':
    main()
