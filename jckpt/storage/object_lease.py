"""The writer lease of a URL: an object created only if absent, kept fresh while held.

`ObjectLease` is what `jckpt.storage.lease.WriterLease` (a `flock`) is for
local paths: at most one mirror or manager writes a checkpoint URL. It is the
object `<url>.jckpt-lease`, created with the store's conditional PUT
(`If-None-Match: *` on S3, a generation precondition on GCS), so of two
writers exactly one gets it; the other gets `InUseError` naming the holder.

A store has no kernel to drop the lease of a killed process, so the holder
rewrites the object every `REFRESH_SECONDS` (a conditional overwrite of its
own version), and a lease is taken over, again by a conditional overwrite of
the version seen, when its holder is gone: a process of this host that no
longer runs, or a holder that has not refreshed it for `STALE_SECONDS`. Of
two writers taking over the same stale lease, one wins.

>>> from jckpt.storage.object_store import ObjectURL
>>> lease = ObjectLease(ObjectURL.parse('memory://doc/run.jckpt'))
>>> try:
...     ObjectLease(ObjectURL.parse('memory://doc/run.jckpt'))
... except InUseError as e:
...     print(e.message.startswith('in use: another writer'))
True
>>> lease.release()
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any

from jckpt.errors import InUseError
from jckpt.format.names import LEASE_SUFFIX
from jckpt.storage.lease import READ_WHILE_HELD
from jckpt.storage.object_store import ObjectURL, obstore_module, store_error, store_for

log = logging.getLogger('jckpt')

#: How often the holder rewrites its lease.
REFRESH_SECONDS = 30.0
#: A lease not rewritten for this long is taken over (its holder died on another host).
STALE_SECONDS = 300.0
_TAKEN = ('AlreadyExistsError', 'PreconditionError')


def record() -> bytes:
    """This writer as a holder record (JSON): its host, its pid, and the time it is written."""
    return json.dumps({'host': socket.gethostname(), 'pid': os.getpid(), 'time': time.time()}).encode()


def gone(holder: dict[str, Any]) -> bool:
    """Whether the holder is surely gone: a process of this host that no longer runs, or a silent one."""
    if time.time() - float(holder.get('time', 0)) > STALE_SECONDS:
        return True
    if holder.get('host') != socket.gethostname():
        return False
    try:
        os.kill(int(holder['pid']), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return False


class ObjectLease:
    """The exclusive writer lease on a URL, taken at construction, released by `release`."""

    def __init__(self, u: ObjectURL) -> None:
        self.path = u.url
        self.lock = ObjectURL.parse(u.url.rstrip('/') + LEASE_SUFFIX)
        self.store, self.obs = store_for(self.lock), obstore_module()
        self._version = self._take()
        self.held = True
        self._pid = os.getpid()  # a forked child's copy never deletes its parent's lease
        self._lost: str | None = None  # who took the lease over, once it is lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name='jckpt-lease', daemon=True)
        self._thread.start()

    @property
    def _taking(self) -> str:
        """What a failure to take the lease was doing (its error names the path written)."""
        return f"taking the writer lease ({self.lock.url.rsplit('/', 1)[-1]})"

    def _take(self) -> dict[str, Any]:
        """Create the lease object, or take over one whose holder is gone; its version.
        A failure is an error naming the path the lease is for (a manager's directory)."""
        try:
            return self._put('create')
        except Exception as e:
            if type(e).__name__ not in _TAKEN:
                raise store_error(e, self._taking, self.path) from e
        holder, version = self._holder()
        if holder is not None and gone(holder):
            try:
                taken = self._put(version)
                log.warning("took over the writer lease of %s from pid %s on %s, which is gone",
                            self.path, holder.get('pid'), holder.get('host'))
                return taken
            except Exception as e:
                if type(e).__name__ not in _TAKEN:
                    raise store_error(e, self._taking, self.path) from e
        who = f" (pid {holder.get('pid')} on {holder.get('host')})" if holder else ''
        raise InUseError(f"in use: another writer{who} holds the lease {self.lock.url.rsplit('/', 1)[-1]}",
                         file=self.path,
                         fix=f"close the other mirror or manager first, or write to another path; a "
                             f"holder that died is taken over after {STALE_SECONDS:.0f} s, or delete "
                             f"{self.lock.url}; {READ_WHILE_HELD}")

    def _put(self, mode: Any) -> dict[str, Any]:
        """Write the lease record: `'create'`, or over the version `mode` only (a conditional PUT)."""
        if isinstance(mode, dict):
            mode = {k: v for k, v in mode.items() if v is not None}
        result = self.obs.put(self.store, self.lock.key, record(), mode=mode)
        return {'e_tag': result.get('e_tag'), 'version': result.get('version')}

    def _holder(self) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """The holder's record and the lease object's version (`None` when unreadable)."""
        try:
            got = self.obs.get(self.store, self.lock.key)
            meta = got.meta
            version = {'e_tag': meta.get('e_tag'), 'version': meta.get('version')}
            return json.loads(bytes(got.bytes())), version
        except Exception:
            return None, {}

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_SECONDS):
            try:
                self._version = self._put(self._version)
            except Exception as e:  # lost (taken over) or unreachable: say so, keep trying if unreachable
                log.error("could not refresh the writer lease of %s: %s", self.path, e)
                if type(e).__name__ in _TAKEN:
                    holder = self._holder()[0] or {}
                    self._lost = f"pid {holder.get('pid')} on {holder.get('host')}"
                    return

    def check(self) -> None:
        """Raise `InUseError` once another writer has taken the lease over: this one must not
        write, nor delete, under the path any more."""
        if self._lost is not None:
            raise InUseError(f"the writer lease was taken over by another writer ({self._lost}): "
                             "this one no longer writes here", file=self.path,
                             fix=f"close this writer; the lease is taken over when its holder "
                                 f"has not refreshed it for {STALE_SECONDS:.0f} s (a stalled "
                                 f"process, or a clock far off), so keep one writer per path")

    def release(self) -> None:
        """Stop refreshing and delete the lease object, unless another writer has taken it (idempotent)."""
        if not self.held:
            return
        self.held = False
        self._stop.set()
        if os.getpid() != self._pid:
            return
        try:
            if self._holder()[1].get('e_tag') == self._version.get('e_tag'):
                self.obs.delete(self.store, self.lock.key)
        except Exception:
            pass

    def __enter__(self) -> ObjectLease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"ObjectLease({self.path!r}, held={self.held})"


__all__ = ['REFRESH_SECONDS', 'STALE_SECONDS', 'ObjectLease', 'gone', 'record']
