"""What a file is, from its first bytes: a jckpt header, or another format's file.

Opening a file that is not a jckpt checkpoint reads its first bytes as a header length,
and the failure says nothing of what the file is. These pure functions tell a jckpt (or
OCANNL) header from a zip archive (a PyTorch `.pt`, a numpy `.npz`), a pickle, gzip,
`.npy`, safetensors or flax's msgpack, so that the error names the file's kind and how
to read it.

>>> looks_like_header(b'\\x00\\x00\\x00\\x20((version 1) (tensors ()))')
True
>>> foreign_kind(b'\\x1f\\x8b\\x08\\x00')
'a gzip-compressed file'
"""

from __future__ import annotations

import struct

from jckpt.errors import FormatError

#: The first bytes of every header jckpt and OCANNL write, after the 4-byte length.
HEADER_START = b'((version'


def looks_like_header(head: bytes) -> bool:
    """Whether a file's first bytes start like a jckpt (or OCANNL) header.

    A 4-byte big-endian header length, at least as long as `HEADER_START`,
    followed (after blanks) by `((version`. Cheap and certain enough to
    tell a checkpoint from another format; decoding the header says whether
    it is a valid one.

    >>> looks_like_header(b'\\x00\\x00\\x00\\x20((version 1) (tensors ()))')
    True
    >>> looks_like_header(ZIP_LOCAL), looks_like_header(b'\\x00\\x00\\x00\\x02((version')
    (False, False)
    """
    if len(head) < 4 + len(HEADER_START):
        return False
    (hlen,) = struct.unpack_from('>I', head, 0)
    return hlen >= len(HEADER_START) and head[4:].lstrip()[:len(HEADER_START)] == HEADER_START


#: A zip archive's first bytes: its first member's local header (a PyTorch `.pt`, a numpy
#: `.npz`); the adapters recognise zip archives by it too.
ZIP_LOCAL = b'PK\x03\x04'


def foreign_kind(head: bytes) -> str | None:
    """What another format's file that is no jckpt file is, from its first 16 bytes (None:
    not one jckpt knows), so that opening it as a checkpoint can say so.

    >>> foreign_kind(ZIP_LOCAL), foreign_kind(b'\\x00\\x00\\x00\\x20((version')
    ('a zip archive (a PyTorch .pt/.pth or numpy .npz file)', None)
    >>> foreign_kind(b'\\x81\\xa6params')[:14]
    'a msgpack file'
    """
    if looks_like_header(head):  # a jckpt file cut short, whatever its length's bytes
        return None
    if head[:4] == ZIP_LOCAL:
        return 'a zip archive (a PyTorch .pt/.pth or numpy .npz file)'
    if head[:2] == b'\x80\x02':
        return 'a pickle (a legacy PyTorch .pt file)'
    if head[:1] == b'\x80' and head[1:2] in (b'\x03', b'\x04', b'\x05'):
        return _PICKLE
    if head[:3] == b'\x1f\x8b\x08':  # gzip's magic and its one method, deflate
        return _GZIP
    if head[:6] == b'\x93NUMPY':
        return 'a numpy .npy file'
    if len(head) >= 9 and head[8:9] == b'{':
        return 'a safetensors file'
    if _msgpack_map(head):
        return _MSGPACK
    return None


def _msgpack_map(head: bytes) -> bool:
    """Whether `head` starts a msgpack map whose first key is a string, as flax writes a state
    dict (a jckpt header this would match is over 2 GiB long)."""
    first = head[0] if head else None
    at = 1 if first is not None and 0x80 <= first <= 0x8f else {0xde: 3, 0xdf: 5}.get(first, 0)
    return 0 < at < len(head) and (0xa0 <= head[at] <= 0xbf or head[at] in (0xd9, 0xda, 0xdb))


#: flax's msgpack checkpoints: `flax.serialization.to_bytes`, flax.training.checkpoints without orbax.
_MSGPACK = 'a msgpack file (flax.serialization.to_bytes, or flax.training.checkpoints without orbax)'
_CONVERT = ("convert it first (jckpt.convert(path, 'model.jckpt'), or jckpt convert on the command "
            "line), or read it with jckpt.adapters.read(path)")
_FROM_BYTES = ("read it with flax.serialization.from_bytes(abstract_target, data) (or "
               "msgpack_restore without a target) and jckpt.save the tree it gives")
#: Python's own pickles (`pickle.dump(params, f)`), which jckpt never loads: unpickling runs code.
_PICKLE = 'a Python pickle (pickle.dump)'
_GZIP = 'a gzip-compressed file'
_FIXES = {_MSGPACK: _FROM_BYTES, _GZIP: "decompress it first (gunzip), then read what it holds",
          _PICKLE: "jckpt never unpickles (it can run code): in a process that trusts the file, "
                   "pickle.load it and jckpt.save the tree it gives"}


def foreign_error(head: bytes, message: str, file: str | None) -> FormatError | None:
    """The error for opening another format's file as a checkpoint: what the file is first,
    then `message` (what failed when it was read as one), and how to convert it; None when
    `head` is no format jckpt knows.

    >>> foreign_error(b'\\x93NUMPY', 'header length 9 is too long', 'w.npy').message
    'it is a numpy .npy file, not a jckpt checkpoint: header length 9 is too long'
    """
    kind = foreign_kind(head)
    if kind is None:
        return None
    return FormatError(f"it is {kind}, not a jckpt checkpoint: {message}", file=file,
                       fix=_FIXES.get(kind, _CONVERT))


__all__ = ['HEADER_START', 'ZIP_LOCAL', 'foreign_error', 'foreign_kind', 'looks_like_header']
