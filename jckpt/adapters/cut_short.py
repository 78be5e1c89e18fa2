"""Recognising another format's file that was cut short (an interrupted copy or download, or a
file still being written), which no format's sniffer accepts any more.

A zip archive (`.npz`, `.pt`) keeps its table of members at its end, and a safetensors file
says its header's length in its first bytes: cut short, neither is recognised, and the file
was refused as "in no format jckpt recognises" (or read as a jckpt header and reported as
another format to convert, which failed the same way). `cut_short_error` says what it is.

Example:
    ```python
    error = cut_short_error('model.pt', head)
    if error is not None:
        raise error
    ```
"""

from __future__ import annotations

import os

from jckpt.adapters._zip import ZIP_END
from jckpt.errors import FormatError
from jckpt.format.sniff import ZIP_LOCAL

#: The most bytes a zip archive's end-of-central-directory record spans (22 bytes and a
#: comment of up to 65,535).
_ZIP_END_SPAN = 22 + 65_535

_FIX = ("wait until whatever writes it has finished, or copy or download it again; "
        "a file cut short cannot be read")


def cut_short_error(path: str, head: bytes | None) -> FormatError | None:
    """The error for the local file at `path` (first bytes `head`) when it is a zip archive
    without its end or a safetensors file shorter than its header says; else None.

    >>> import tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), 'm.npz')
    >>> with open(p, 'wb') as f:
    ...     _ = f.write(ZIP_LOCAL + bytes(60))
    >>> print(cut_short_error(p, ZIP_LOCAL + bytes(60)).message)  # doctest: +ELLIPSIS
    the file is cut short: a zip archive (an .npz or .pt file) of 64 bytes without its end, ...
    """
    if head is None:
        return None
    try:
        size = os.path.getsize(path)
    except OSError:
        return None  # a URL, or gone: whoever reads it next says so
    what = _zip_without_end(path, head, size) or _short_safetensors(head, size)
    if what is None:
        return None
    return FormatError(f"the file is cut short: {what} (an interrupted copy, download or "
                       "write, or a file still being written)", file=path, fix=_FIX)


def _zip_without_end(path: str, head: bytes, size: int) -> str | None:
    if head[:4] != ZIP_LOCAL:
        return None
    with open(path, 'rb') as f:
        f.seek(max(0, size - _ZIP_END_SPAN))
        tail = f.read()
    if ZIP_END in tail:
        return None  # a whole archive, of no format jckpt reads
    return (f"a zip archive (an .npz or .pt file) of {size} bytes without its end, which "
            "lists its members")


def _short_safetensors(head: bytes, size: int) -> str | None:
    from jckpt.adapters.safetensors_header import header_end  # the sniffer's own reading of `head`

    end = header_end(head)
    if end is None or end <= size:
        return None
    return f"a safetensors file whose header says {end} bytes of header, in a file of {size}"


__all__ = ['cut_short_error']
