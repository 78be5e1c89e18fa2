"""Opening local files to read, regular files only: the one open every local reader uses.

A FIFO, a device or a socket (a planted one, or a symbolic link to one such as
`/dev/zero`) is refused before a byte is read, and without blocking: opening a
FIFO for reading would wait for a writer forever, and a device never ends.
The checkpoint reader, the mapping of a foreign file, the small JSON files of
the adapters and the sniffing of `jckpt.tools.classify` all open through
`open_regular`, so each refuses the same things with the same words.

>>> with open_regular(__file__) as f:
...     f.read(3) == open(__file__, 'rb').read(3)
True
>>> try:
...     open_regular('/dev/null')
... except FormatError as e:
...     print(e.message)
is a character device, not a regular file
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

from jckpt.errors import FormatError

_SPECIAL = ((stat.S_ISFIFO, 'a FIFO (named pipe)'), (stat.S_ISCHR, 'a character device'),
            (stat.S_ISBLK, 'a block device'), (stat.S_ISSOCK, 'a socket'))


def special_name(mode: int) -> str:
    """What a file of this `st_mode` is, in words, when it is neither regular nor a directory.

    >>> special_name(stat.S_IFIFO)
    'a FIFO (named pipe)'
    """
    return next((name for test, name in _SPECIAL if test(mode)), 'a special file')


def open_regular(path: str, *, follow_symlinks: bool = True) -> BinaryIO:
    """`open(path, 'rb')` of a regular file only.

    A directory raises `IsADirectoryError` (each caller says what to pass instead); a FIFO,
    device or socket raises `FormatError` naming it. `follow_symlinks=False` refuses a
    symbolic link with `OSError(ELOOP)` (for names read from another file, such as a
    directory checkpoint's pieces). A missing file raises `FileNotFoundError`.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:  # a socket cannot be opened (ENXIO): say what it is
        mode = _mode(path, follow_symlinks) if e.errno == errno.ENXIO else None
        if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            raise FormatError(f"is {special_name(mode)}, not a regular file", file=path,
                              fix="pass a checkpoint file; jckpt never reads special files") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            raise FormatError(f"is {special_name(mode)}, not a regular file", file=path,
                              fix="pass a checkpoint file; jckpt never reads special files")
        os.set_blocking(fd, True)
        return os.fdopen(fd, 'rb')
    except BaseException:
        os.close(fd)
        raise


def _mode(path: str, follow_symlinks: bool) -> int | None:
    try:
        return os.stat(path, follow_symlinks=follow_symlinks).st_mode
    except OSError:
        return None


__all__ = ['open_regular', 'special_name']
