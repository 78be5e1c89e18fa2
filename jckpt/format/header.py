"""The header's decoding from bytes, and its encoding (from `jckpt.format.header_encoder`).

`encode_header` and `decode_header` are exact inverses on valid headers and
follow `docs/format.md`: a 4-byte big-endian length, then the S-expression text
padded with spaces so that the data starts at a multiple of the alignment.
`decode_header` validates everything that can be checked without the file's
size (see `jckpt.format.layout.check_extents` for the rest) and raises
`FormatError` for every fault, never anything else. The
values (`Entry`, `Header`, ...) live in `jckpt.format.entries`;
headers laid out as jckpt writes them decode through `jckpt.format.fastpath`.

>>> e = Entry(id=0, namespace='jckpt', label=('w',), prec='Single_prec', dims=(2,),
...           offset=0, byte_length=8, path=(('k', 'w'),))
>>> raw = encode_header(Header(tensors=(e,)))
>>> len(raw) % 32, decode_header(raw).tensors[0] == e
(0, True)
"""

from __future__ import annotations

import math
import struct
from typing import Any

from jckpt.errors import FormatError
from jckpt.format import header_seal, limits, precs, prescan
from jckpt.format._gc import paused

# The header's values are defined in ``entries``; they stay importable from here too.
from jckpt.format.entries import DEFAULT_ALIGNMENT as DEFAULT_ALIGNMENT
from jckpt.format.entries import (
    FORMAT_VERSION,
    INT_KINDS,
    LEGACY_NAMESPACE,
    MAX_INT64,
    NAMESPACE_RE,
    PATH_KINDS,
    Entry,
    Header,
    KeyPath,
    Padding,
    path_name,
)
from jckpt.format.entries import round_up as round_up
from jckpt.format.fastpath import (
    RepeatedEntry,
    canonical_entries,
    canonical_shell,
    with_canonical_lists,
)

# The encoder lives in ``header_encoder``; its names stay importable from here too.
from jckpt.format.header_encoder import encode_header as encode_header
from jckpt.format.header_encoder import encode_header_with_slots as encode_header_with_slots
from jckpt.format.header_encoder import header_text as header_text
from jckpt.format.sexp import Sexp, SexpError, dumps, parse

#: OCANNL's reader refuses headers longer than this; jckpt reads them but warns on write.
OCANNL_HEADER_LIMIT = 100_000_000


# --- decoding --------------------------------------------------------------

def _fail(msg: str, file: str | None, entry: str | None = None) -> FormatError:
    return FormatError(msg, file=file, entry=entry,
                       fix="the file is damaged or was not written by a compatible writer")


def _older_ocannl(msg: str, file: str | None, entry: str) -> FormatError:
    """A padding field in a form FORMAT.md refuses but an older OCANNL writer wrote (`none` or
    a hex float as the value, fewer `(L R)` pairs than dims): said so, with the way out."""
    return FormatError(
        f"{msg}: this looks like a file from an older OCANNL writer (a padding must be none or "
        "(((L R) ...) VALUE), one (L R) per dim and VALUE a decimal float such as 0.)",
        file=file, entry=entry,
        fix="load it with a current OCANNL and save it again, then read that file")


def _int(atom: Sexp, what: str, file: str | None, entry: str | None = None) -> int:
    if isinstance(atom, str) and atom.isascii():
        digits = atom[1:] if atom[:1] == '-' else atom
        if digits.isdigit():
            if len(digits) > limits.MAX_INT_DIGITS:
                raise _fail(f"{what} has {len(digits)} digits, more than any 64-bit integer",
                            file, entry)
            return int(atom)
    raise _fail(f"{what} must be an integer, got {dumps(atom) if _sexp_ok(atom) else atom!r}",
                file, entry)


def _sexp_ok(x: Any) -> bool:
    return isinstance(x, (str, list))


def _fields(node: Sexp, what: str, file: str | None, entry: str | None = None) -> dict[str, Sexp]:
    """A list of `(key value)` pairs as an ordered dict; refuses anything else."""
    if not isinstance(node, list):
        raise _fail(f"{what} must be a list of (key value) pairs", file, entry)
    out: dict[str, Sexp] = {}
    for field in node:
        if not (isinstance(field, list) and len(field) == 2 and isinstance(field[0], str)):
            raise _fail(f"{what}: field {_short(field)} is not a (key value) pair", file, entry)
        if field[0] in out:
            raise _fail(f"{what}: field {field[0]} appears twice", file, entry)
        out[field[0]] = field[1]
    return out


def _short(x: Sexp) -> str:
    text = dumps(x)
    return text if len(text) <= 60 else text[:57] + '...'


def _int_list(node: Sexp, what: str, file: str | None, entry: str | None) -> tuple[int, ...]:
    if not isinstance(node, list):
        raise _fail(f"{what} must be a list of integers", file, entry)
    return tuple(_int(x, what, file, entry) for x in node)


def _decode_padding(node: Sexp, ndim: int, file: str | None, entry: str) -> Padding | None:
    if node == 'none':
        return None
    if not (isinstance(node, list) and len(node) == 2 and isinstance(node[0], list)
            and isinstance(node[1], str)):
        fail = _older_ocannl if isinstance(node, list) else _fail
        raise fail(f"padding must be none or (((L R) ...) VALUE), got {_short(node)}", file, entry)
    pairs = []
    for pair in node[0]:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise _fail(f"padding pair {_short(pair)} is not (L R)", file, entry)
        lo, hi = (_int(x, 'padding', file, entry) for x in pair)
        if lo < 0 or hi < 0:
            raise _fail("padding is negative", file, entry)
        pairs.append((lo, hi))
    if len(pairs) != ndim:
        fail = _older_ocannl if len(pairs) < ndim else _fail
        raise fail(f"padding has {len(pairs)} (L R) pairs for {ndim} dims", file, entry)
    try:
        value = float(node[1])
    except ValueError:
        raise _older_ocannl(f"padding value {node[1]!r} is not a float", file, entry) from None
    return Padding(tuple(pairs), value)


def _decode_path(node: Sexp, file: str | None, entry: str) -> KeyPath:
    if not isinstance(node, list):
        raise _fail("path must be a list of components", file, entry)
    try:
        limits.check_path_length(len(node))
    except ValueError as e:
        raise _fail(str(e), file, entry) from None
    out = []
    for comp in node:
        if not (isinstance(comp, list) and len(comp) == 2 and isinstance(comp[0], str)
                and comp[0] in PATH_KINDS
                and isinstance(comp[1], str)):
            raise _fail(f"path component {_short(comp)} is not (k|ki|i|a|f VALUE)", file, entry)
        kind, value = comp
        out.append((kind, _int(value, 'path index', file, entry) if kind in INT_KINDS else value))
    return tuple(out)


_ENTRY_REQUIRED = ('id', 'namespace', 'prec', 'dims', 'offset', 'byte_length')
_ENTRY_KNOWN = frozenset(_ENTRY_REQUIRED) | {'label', 'padding', 'path', 'checksum', 'key_impl',
                                             'slice', 'global_dims'}


def _decode_entry(node: Sexp, index: int, file: str | None) -> Entry:
    f = _entry_fields(node, f"#{index}", file)
    namespace, ident = _decode_identity(f, f"#{index}", file)
    where = f"{namespace}/n{ident}"
    if ident < 0:
        raise _fail("id is negative", file, where)
    path = _decode_path(f['path'], file, where) if 'path' in f else None
    if path is not None:
        where = f"{namespace}/{path_name(path)}"
    prec, dims, padding, offset, byte_length = _decode_extent(f, file, where)
    label = f.get('label', [])
    if not (isinstance(label, list) and all(isinstance(x, str) for x in label)):
        raise _fail("label must be a list of atoms", file, where)
    checksum = _decode_checksum(f['checksum'], file, where) if 'checksum' in f else None
    key_impl = f.get('key_impl')
    if key_impl is not None and not isinstance(key_impl, str):
        raise _fail("key_impl must be an atom", file, where)
    slc, global_dims = _decode_piece(f, dims, file, where)
    extra = tuple(_freeze([k, v]) for k, v in f.items() if k not in _ENTRY_KNOWN)
    return Entry(id=ident, namespace=namespace, prec=prec, dims=dims, offset=offset,
                 byte_length=byte_length, label=tuple(label), padding=padding, path=path,
                 checksum=checksum, key_impl=key_impl, slice=slc, global_dims=global_dims,
                 extra=extra)


def _entry_fields(node: Sexp, where: str, file: str | None) -> dict[str, Sexp]:
    """The entry's fields, refusing a malformed list or a missing required field."""
    f = _fields(node, f"tensor {where}", file, where)
    for key in _ENTRY_REQUIRED:
        if key not in f:
            raise _fail(f"missing required field {key}", file, where)
    return f


def _decode_identity(f: dict[str, Sexp], where: str, file: str | None) -> tuple[str, int]:
    """`(namespace, id)`; the legacy empty namespace reads as `LEGACY_NAMESPACE`."""
    namespace = f['namespace']
    if not isinstance(namespace, str):
        raise _fail("namespace must be an atom", file, where)
    if namespace == '':
        namespace = LEGACY_NAMESPACE
    elif not NAMESPACE_RE.match(namespace):
        raise _fail(f"invalid namespace {namespace!r}: must match [A-Za-z_][A-Za-z0-9_]*",
                    file, where)
    return namespace, _int(f['id'], 'id', file, where)


def _decode_extent(f: dict[str, Sexp], file: str | None, where: str
                   ) -> tuple[str, tuple[int, ...], Padding | None, int, int]:
    """`(prec, dims, padding, offset, byte_length)`, checked against each other."""
    prec = f['prec']
    if not isinstance(prec, str) or prec not in precs.ALL_PRECS:
        raise _fail(f"unknown prec {_short(prec)}", file, where)
    dims = _int_list(f['dims'], 'dims', file, where)
    if any(d < 0 for d in dims):
        raise _fail(f"negative dim in {dims}", file, where)
    padding = _decode_padding(f.get('padding', 'none'), len(dims), file, where)
    offset = _int(f['offset'], 'offset', file, where)
    byte_length = _int(f['byte_length'], 'byte_length', file, where)
    if offset < 0 or byte_length < 0:
        raise _fail("offset and byte_length must be >= 0", file, where)
    if offset > MAX_INT64 or byte_length > MAX_INT64:
        raise _fail("offset or byte_length overflows 64 bits", file, where)
    _check_size(prec, dims, padding, byte_length, file, where)
    try:
        limits.check_shape(dims, precs.element_size(prec))
    except ValueError as e:
        raise _fail(f"dims are beyond what numpy can represent: {e}", file, where) from None
    return prec, dims, padding, offset, byte_length


def _check_size(prec: str, dims: tuple[int, ...], padding: Padding | None, byte_length: int,
                file: str | None, where: str) -> None:
    """Refuse padding wider than the dims, 64-bit overflow, and a byte_length that disagrees."""
    logical = dims if padding is None else tuple(
        d - lo - hi for d, (lo, hi) in zip(dims, padding.pairs))
    if any(d < 0 for d in logical):
        raise _fail(f"padding {padding.pairs} exceeds dims {dims}", file, where)
    count = math.prod(dims)
    if count > MAX_INT64 or count * max(precs.element_size(prec), 1) > MAX_INT64:
        raise _fail(f"element count of dims {dims} overflows 64 bits", file, where)
    expected = math.prod(logical) * precs.element_size(prec)
    if byte_length != expected:
        raise _fail(f"byte_length {byte_length} disagrees with dims {dims}, "
                    f"padding and {prec} ({expected} bytes)", file, where)


def _decode_checksum(c: Sexp, file: str | None, where: str) -> tuple[str, str]:
    if not (isinstance(c, list) and len(c) == 2 and all(isinstance(x, str) for x in c)):
        raise _fail("checksum must be (ALGORITHM HEX)", file, where)
    return (c[0], c[1])


def _decode_piece(f: dict[str, Sexp], dims: tuple[int, ...], file: str | None, where: str
                  ) -> tuple[tuple[tuple[int, int], ...] | None, tuple[int, ...] | None]:
    """`(slice, global_dims)` of a piece of a directory checkpoint's array (both or neither)."""
    slc = None
    if 'slice' in f:
        s = f['slice']
        if not (isinstance(s, list) and all(isinstance(p, list) and len(p) == 2 for p in s)):
            raise _fail("slice must be ((START STOP) ...)", file, where)
        slc = tuple((_int(a, 'slice', file, where), _int(b, 'slice', file, where)) for a, b in s)
    global_dims = _int_list(f['global_dims'], 'global_dims', file, where) \
        if 'global_dims' in f else None
    if (slc is None) != (global_dims is None):
        raise _fail("slice and global_dims must appear together", file, where)
    if slc is not None and not (len(slc) == len(global_dims) == len(dims) and all(
            0 <= a <= b <= g and b - a == d for (a, b), g, d in zip(slc, global_dims, dims))):
        raise _fail(f"slice {slc} does not fit global_dims {global_dims} and dims {dims}",
                    file, where)
    return slc, global_dims


def _freeze(x: Sexp) -> Any:
    """Lists as tuples, all the way down (a directory index holds millions of them)."""
    if not isinstance(x, list):
        return x
    return tuple([_freeze(v) if isinstance(v, list) else v for v in x])


_HEADER_KNOWN = frozenset({'version', 'alignment', 'tensors', 'writer', 'metadata',
                           header_seal.HEADER_CHECKSUM_FIELD})

def split_header(raw: bytes | memoryview, file_size: int | None = None,
                 file: str | None = None) -> tuple[int, int]:
    """`(hlen, data_start)` from a file's first 4 bytes, checked against its size."""
    if len(raw) < 4:
        raise _fail(f"file is {len(raw)} bytes, shorter than the 4-byte header length", file)
    (hlen,) = struct.unpack_from('>I', raw, 0)
    size = len(raw) if file_size is None else file_size
    if 4 + hlen > size:
        raise _fail(f"header length {hlen} extends past the end of the file ({size} bytes)", file)
    return hlen, 4 + hlen


@paused  # decoding allocates millions of small objects and no cycles
def decode_header(raw: bytes | memoryview, *, file: str | None = None) -> Header:
    """Decode and validate a header from the file's first `4 + HLEN` bytes (or more).

    Raises:
        FormatError: naming `file`, for every fault; also when decoding it runs out of
            memory (a crafted header of tens of MB off jckpt's layout builds hundreds of MB
            of lists: the error then says so, where a bare `MemoryError` named nothing).
    """
    hlen, start = split_header(raw, None, file)
    try:
        return _decode(raw, start, file)
    except MemoryError:
        raise FormatError(f"the header ({hlen} bytes) needs more memory to read than is "
                          "available", file=file,
                          fix="read it where more memory is free; a header this large that "
                              "jckpt's fast reader does not take was likely damaged or "
                              "crafted") from None


def _decode(raw: bytes | memoryview, start: int, file: str | None) -> Header:
    try:
        text = str(memoryview(raw)[4:start], 'utf-8')  # no copy of the bytes first
    except UnicodeDecodeError as e:
        raise _fail(f"header is not UTF-8 ({e.reason} at byte {4 + e.start})", file) from None
    why = prescan.unbalanced(memoryview(raw)[4:start])  # before the fast decoder builds every
    if why is not None:  # entry, and the general reader copies of the text, to come to the end
        raise _fail(f"header is not a well-formed S-expression: {why}", file)
    try:  # an entry repeated verbatim stops the fast decoder before it builds the rest
        fast = canonical_entries(text)
    except RepeatedEntry as e:
        raise _fail(str(e), file, f"#{e.index}") from None
    head = memoryview(raw)[:start]  # what the header checksum covers
    scanned = None  # the text whose scan for crafted repetitions is done
    try:
        if fast is not None:
            entries, list_open, list_close = fast
            cut = (list_open, list_close) if entries else None  # an empty list: read as it is
            shell = canonical_shell(text, cut)  # the other fields as jckpt writes them
            if shell is not None:
                header_seal.check_header_checksum(head, shell, file)
                return header_from_sexp(shell, file=file, entries=entries)
            if cut is not None:  # scanned on its bytes, entries left out, before a copy is
                prescan.check_header(head[4:], cut)  # cut (entries are ASCII: places agree)
                text = scanned = text[:list_open] + '()' + text[list_close + 1:]
        whole = text

        def decode(t: str) -> Header:
            if t is not scanned:  # crafted repetitions, refused before any list is built:
                prescan.check_header(head[4:] if t is whole and scanned is None else t)
            return _from_text(t, file, fast and entries, head)  # on the bytes read if it can
        # a repetition found in the text with an index's pieces cut out is one in the whole
        return with_canonical_lists(text, decode, file)
    except prescan.ShapeError as e:
        raise _fail(str(e), file, e.entry) from None


def _from_text(text: str, file: str | None, entries: list[Entry] | None, head: memoryview) -> Header:
    try:
        tree = parse(text)
    except SexpError as e:
        raise _fail(f"header is not a well-formed S-expression: {e}", file) from None
    header_seal.check_header_checksum(head, tree, file)
    return header_from_sexp(tree, file=file, entries=entries)


def header_from_sexp(tree: Sexp, *, file: str | None = None,
                     entries: list[Entry] | None = None) -> Header:
    """Build and validate a `Header` from the parsed S-expression."""
    f = _fields(tree, "header", file)
    for key in ('version', 'tensors'):
        if key not in f:
            raise _fail(f"header is missing required field {key}", file)
    version = _int(f['version'], 'version', file)
    if version != FORMAT_VERSION:
        raise FormatError(f"unsupported checkpoint version: {version}", file=file,
                          fix="read it with the jckpt release that wrote it")
    alignment = _int(f['alignment'], 'alignment', file) if 'alignment' in f else 1
    if alignment < 1:
        raise _fail(f"alignment {alignment} is < 1", file)
    if alignment > limits.MAX_ALIGNMENT:
        raise _fail(f"alignment {alignment} is absurdly large (more than {limits.MAX_ALIGNMENT})",
                    file)
    if not isinstance(f['tensors'], list):
        raise _fail("tensors must be a list of entries", file)
    if entries is not None and f['tensors'] == []:
        tensors = tuple(entries)
    else:
        tensors = tuple(_decode_entry(node, i, file) for i, node in enumerate(f['tensors']))
    identities = [(e.namespace, e.id if e.path is None else e.path) for e in tensors]
    if len(set(identities)) != len(identities):
        seen: set = set()
        for e, identity in zip(tensors, identities):
            if identity in seen:
                raise _fail("duplicate entry identity", file, e.name)
            seen.add(identity)
    writer = f.get('writer')
    if writer is not None and not isinstance(writer, str):
        raise _fail("writer must be an atom", file)
    metadata: list[tuple[str, str]] = []
    if 'metadata' in f:
        m = f['metadata']
        if not (isinstance(m, list) and all(isinstance(p, list) and len(p) == 2 and all(
                isinstance(x, str) for x in p) for p in m)):
            raise _fail("metadata must be a list of (KEY VALUE) string pairs", file)
        metadata = [(k, v) for k, v in m]
    extra = tuple(_freeze([k, v]) for k, v in f.items() if k not in _HEADER_KNOWN)
    return Header(tensors=tensors, alignment=alignment, version=version, writer=writer,
                  metadata=tuple(metadata), extra=extra)


