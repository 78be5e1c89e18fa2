"""What a background writer reports: `MirrorCounters`, one consistent reading of its progress.

The one-line summary keeps the same words for every writer (the mirror, the
manager), so logs and dashboards can parse it:

>>> print(MirrorCounters(committed=3, durable=2, generation=2, pending=1))
memory mirror: committed 3 durable 2 generation 2 pending 1 error 0
>>> error_code(OSError(28, 'No space left on device'))
'ENOSPC'
"""

from __future__ import annotations

import copy
import dataclasses
import errno as errno_mod

from jckpt.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class MirrorCounters:
    """A consistent reading of a mirror's progress; `str()` is the one-line summary.

    Attributes:
      committed: snapshots accepted by `submit` so far.
      durable: the number (1-based, in submit order) of the last accepted
        snapshot that is now synchronized on disk (or found identical to it).
      generation: the generation number in the file (0: none written yet).
      pending: slots whose snapshot is waiting to be written or being written.
      error: `0`, or the persistence error of the last failed write while no write has
        succeeded since (a snapshot being retried, a directory step whose save raised), or
        what stopped the writer thread, as an errno name (`"ENOSPC"`) or the error's class
        name. A snapshot dropped for what it holds (an `InputError`) is not one: the storage
        works, so it shows in `failures` and `last_error`, and `wait_durable` raises it.
      failures: failed write attempts since the mirror opened, drops included.
      last_error: the message of the most recent failure, kept after recovery.
      stalls: submits that had to wait for a free slot (the disk is not keeping up).
      images: snapshots taken as an image on their device (drained in the background).
    """

    committed: int = 0
    durable: int = 0
    generation: int = 0
    pending: int = 0
    error: int | str = 0
    failures: int = 0
    last_error: str | None = None
    stalls: int = 0
    images: int = 0

    def __str__(self) -> str:
        return (f"memory mirror: committed {self.committed} durable {self.durable} "
                f"generation {self.generation} pending {self.pending} error {self.error}")


def error_code(exc: BaseException) -> str:
    """How the counters name an error: its errno name (`"ENOSPC"`) or its class name."""
    code = getattr(exc, 'errno', None)
    if isinstance(code, int) and code in errno_mod.errorcode:
        return errno_mod.errorcode[code]
    return type(exc).__name__


def kept_error(exc: BaseException) -> BaseException:
    """`exc`, the failure of a snapshot the writer keeps and retries, with a fix that says so:
    its "free disk space, then save again" sent a manager's user to save the step again,
    which is refused as not above the last, while the writer would write it unasked.

    >>> from jckpt.errors import StorageError
    >>> kept_error(StorageError('writing failed', errno=28, fix='free disk space, then save again')).fix
    'free disk space: the snapshot is kept and retried, and the next wait_durable() or close() \
writes it (do not save or submit it again)'
    """
    if not isinstance(exc, CheckpointError):
        return exc
    out = copy.copy(exc)  # the writer's own record of the failure stays as it was
    out.__cause__ = exc.__cause__
    first = (exc.fix or '').removesuffix(', then save again').removesuffix('; save elsewhere')
    out.fix = (f"{first + ': ' if first else ''}the snapshot is kept and retried, and the next "
               "wait_durable() or close() writes it (do not save or submit it again)")
    return out


__all__ = ['MirrorCounters', 'error_code', 'kept_error']
