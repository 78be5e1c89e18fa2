"""Progress bars for long saves, loads, verifies and conversions, on stderr only.

A bar is drawn only when it was asked for (`progress=True` in the Python
API; the command line asks by default) *and* stderr is an interactive
terminal: never in a pipe, a redirected file or a CI log, where it would only
add noise. `rich` draws it and is imported only when a bar is actually shown,
so asking for progress costs nothing elsewhere.

>>> with bar("saving model.jckpt", total=1024, enabled=False) as b:
...     b.advance(1024)          # a no-op: no bar was asked for
>>> b.done
1024
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any


def wanted(requested: bool, stream: IO[str] | None = None) -> bool:
    """Whether a bar should be drawn: asked for, on a terminal, and not in CI.

    `stream` defaults to `sys.stderr`. A terminal of type `dumb` and an
    environment with `CI` set (continuous-integration runners set it) count
    as not interactive.
    """
    if not requested:
        return False
    stream = sys.stderr if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False
    if not tty:
        return False
    if os.environ.get('TERM') == 'dumb':
        return False
    ci = os.environ.get('CI', '')
    return ci.lower() in ('', '0', 'false', 'no')


class Bar:
    """A byte-counting progress bar (a silent counter when not drawn).

    Use through `bar`. `advance(n)` adds `n` bytes; `done` is the
    running total, kept whether or not anything is drawn.
    """

    def __init__(self, description: str, total: int, *, draw: bool,
                 stream: IO[str] | None = None) -> None:
        self.description = description
        self.total = max(int(total), 0)
        self.done = 0
        self._progress: Any = None
        self._task: Any = None
        if draw:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            console = Console(file=sys.stderr if stream is None else stream, force_terminal=True)
            self._progress = Progress(TextColumn('{task.description}'), BarColumn(),
                                      DownloadColumn(), TransferSpeedColumn(),
                                      TimeRemainingColumn(), console=console, transient=True)
            self._task = self._progress.add_task(description, total=self.total or None)
            self._progress.start()  # draws at once, then refreshes in the background

    @property
    def drawn(self) -> bool:
        """Whether this bar is being drawn on a terminal."""
        return self._progress is not None

    def advance(self, nbytes: int) -> None:
        """Count `nbytes` more bytes as done."""
        self.done += nbytes
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done)

    def close(self) -> None:
        """Stop drawing (the bar is removed from the terminal)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Bar({self.description!r}, {self.done}/{self.total} bytes, drawn={self.drawn})"


def bar(description: str, total: int, *, enabled: bool = True,
        stream: IO[str] | None = None) -> Bar:
    """A `Bar` for `total` bytes, drawn only if `wanted` says so.

    Example:
        ```python
        with progress.bar("verifying ckpt.jckpt", total=nbytes, enabled=progress) as b:
            for entry in entries:
                check(entry)
                b.advance(entry.byte_length)
        ```
    """
    return Bar(description, total, draw=wanted(enabled, stream), stream=stream)


__all__ = ['Bar', 'bar', 'wanted']
