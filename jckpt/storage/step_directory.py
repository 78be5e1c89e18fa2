"""Step directories: a few files written into a hidden staged directory, published by one rename.

The manager's format layer (`jckpt.services.formats`) writes a step as a
directory of files in several formats. They are written into a staged
directory next to the step (`<target>.jckpt-next.<n>`); `publish_dir`
fsyncs every file and the directory, renames it to the step's name and fsyncs
the parent, so a reader sees the whole step or nothing. A directory is a
published step when it holds its marker file (written last).

>>> import os, tempfile
>>> root = tempfile.mkdtemp()
>>> staged, target = os.path.join(root, 'step.next'), os.path.join(root, 'step')
>>> make_staged(staged)
>>> write_text(os.path.join(staged, 'marker.json'), '{}')
>>> publish_dir(staged, target, durable=True)
>>> sorted(os.listdir(root)), is_published(target, 'marker.json')
(['step'], True)
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from jckpt.errors import FormatError
from jckpt.format import strict_json
from jckpt.format.limits import MAX_RECORD_BYTES
from jckpt.format.names import OPTIMIZER_NAME, TRAINER_STATE_NAME
from jckpt.storage.backend import LOCAL, Backend, backend_for
from jckpt.storage.publish import exchange, fsync_dir, fsync_file, storage_error
from jckpt.storage.regular import open_regular
from jckpt.storage.staging import discard_staged


def make_staged(temporary: str) -> None:
    """An empty staged directory at `temporary` (what an earlier attempt left is removed)."""
    remove_staged_dir(temporary)
    try:
        os.makedirs(temporary)
    except OSError as e:
        raise storage_error(e, "creating the staged step directory", temporary) from e


def write_text(path: str, text: str) -> None:
    """Write `text` (UTF-8) as the file `path` of a staged directory (made durable on publish)."""
    try:
        with open(path, 'w', encoding='utf-8') as f:
            f.write(text)
    except OSError as e:
        raise storage_error(e, "writing", path) from e


def read_text(path: str) -> str:
    """The text (UTF-8) of the file `path` (or of the object, for a URL)."""
    backend = backend_for(path)
    if backend is not LOCAL:  # one ranged GET (no HEAD or LIST first); missing: NO_SUCH_OBJECT
        raw = backend.head(path, MAX_RECORD_BYTES + 1)
        if len(raw) > MAX_RECORD_BYTES:
            raise _too_large(path)
        return _text(raw, path)
    _refuse_link(path)
    try:
        with open_regular(path) as f:  # a FIFO there is refused, never waited on
            raw = f.read(MAX_RECORD_BYTES + 1)
    except IsADirectoryError:
        raise FormatError("is a directory, not a file", file=path,
                          fix="the step is damaged: restore an earlier step") from None
    except OSError as e:
        raise storage_error(e, "reading", path) from e
    if len(raw) > MAX_RECORD_BYTES:
        raise _too_large(path)
    return _text(raw, path)


def _too_large(path: str) -> FormatError:
    return FormatError(f"holds over {MAX_RECORD_BYTES} bytes, more than a step's text file ever "
                       "does", file=path, fix="the step is damaged or crafted")


def _text(raw: bytes, path: str) -> str:
    try:
        return raw.decode('utf-8')
    except UnicodeDecodeError as e:
        raise FormatError(f"not UTF-8 text ({e})", file=path, fix="the step is damaged") from None


def _refuse_link(path: str) -> None:
    """Refuse a step's member that is a symbolic link: what a step holds lives inside it
    (a link could make a restore read any file the process can)."""
    if os.path.islink(path):
        raise FormatError("is a symbolic link: a step's files live inside its directory",
                          file=path, fix="the step is damaged or crafted: replace the link by "
                                         "the file it names")


def check_step_link(path: str) -> None:
    """Refuse a manager's step at `path` that is a symbolic link leading out of the manager's
    directory (the one that holds `path`); a link to a step inside it is followed.

    A manager reads every step it lists, and restores the latest: a link planted
    in its directory could make it read (and offer as a resume point) any
    checkpoint or file the process can reach. Retention unlinks a link step
    and leaves what it points at.

    >>> check_step_link('run/step_00000001.jckpt')   # not a link: nothing to check
    """
    if backend_for(path) is not LOCAL or not os.path.islink(path):
        return
    root = os.path.realpath(os.path.dirname(path) or '.')
    target = os.path.realpath(path)
    if target == root or os.path.commonpath([root, target]) != root:
        raise FormatError(f"is a symbolic link to {target}, outside the manager's directory",
                          file=path, fix="copy the step into the directory (cp -rL) in place of "
                                         "the link, or open a manager on the directory it is in")


def publish_dir(temporary: str, target: str, *, durable: bool, marker: str | None = None) -> None:
    """fsync every file of `temporary` and the directory, put it at `target` (replacing a step
    directory there: a retry whose rename went through), fsync the parent.

    A `target` in an object store (a URL) gets every file of the local
    `temporary` uploaded under its prefix, `marker` last (the step exists
    once its marker does), and `temporary` is removed.
    """
    backend = backend_for(target)
    if backend is not LOCAL:
        _upload_dir(backend, temporary, target, marker)
        return
    try:
        if durable:
            for name in os.listdir(temporary):
                fsync_file(os.path.join(temporary, name))
            fsync_dir(temporary)
        if os.path.lexists(target):  # a retry whose rename went through, or the step saved again
            _replace(temporary, target)
        else:
            os.rename(temporary, target)
        if durable:
            fsync_dir(os.path.dirname(os.path.abspath(target)))
    except OSError as e:
        raise storage_error(e, "publishing the step directory", target) from e


def _replace(temporary: str, target: str) -> None:
    """Put the directory `temporary` in place of the step directory `target` (a rename cannot
    replace a directory that holds files): swapped in one step where the filesystem can,
    else `target` is renamed aside first (`<temporary>.old`), and a manager's open puts it
    back should the process die before the second rename (`recover_aside`)."""
    if exchange(temporary, target):
        remove_staged_dir(temporary)  # the old step, swapped out
        return
    aside = temporary + ASIDE_SUFFIX
    remove_staged_dir(aside)  # one an earlier attempt left
    os.rename(target, aside)
    os.rename(temporary, target)
    remove_staged_dir(aside)


#: The ending of a step directory `_replace` set aside.
ASIDE_SUFFIX = '.old'


def recover_aside(path: str, target: str) -> bool:
    """Put back the step directory `target` that `_replace` set aside at `path`, when the
    step is missing (its writer died between the two renames); True if it did so."""
    if not path.endswith(ASIDE_SUFFIX) or os.path.lexists(target) or not os.path.isdir(path):
        return False
    try:
        os.rename(path, target)
    except OSError as e:
        raise storage_error(e, "putting back the step directory set aside", target) from e
    return True


def _upload_dir(backend: Backend, temporary: str, target: str, marker: str | None) -> None:
    files = sorted(os.path.relpath(os.path.join(root, name), temporary)
                   for root, _dirs, names in os.walk(temporary) for name in names)
    for name in sorted(files, key=lambda n: n == marker):  # the marker last
        backend.upload(os.path.join(temporary, name), f"{target}/{name.replace(os.sep, '/')}")
    remove_staged_dir(temporary)


def remove_staged_dir(temporary: str) -> None:
    """Remove a staged directory (or file) that will not be published; gone already is fine."""
    if os.path.isdir(temporary) and not os.path.islink(temporary):
        shutil.rmtree(temporary, ignore_errors=True)
    else:
        discard_staged(temporary)


def is_published(path: str, marker: str) -> bool:
    """Whether `path` is a directory holding the file `marker` (a published step)."""
    backend = backend_for(path)
    if backend is not LOCAL:
        return backend.exists(f"{path}/{marker}")
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, marker))


def is_file(path: str) -> bool:
    """Whether `path` is a file (a step's model or optimizer file; for a URL, an object); a
    symbolic link there is a `FormatError`."""
    backend = backend_for(path)
    if backend is not LOCAL:
        return backend.exists(path)
    _refuse_link(path)
    return os.path.isfile(path)


def read_record(path: str, step: int | None = None) -> dict[str, Any]:
    """The checked content of a step directory's `trainer_state.json`."""
    file = os.path.join(path, TRAINER_STATE_NAME)
    where = f"step {step}" if step is not None else "the step"
    text = read_text(file)
    try:
        record = strict_json.loads(text)  # a non-finite metric is written tagged
    except ValueError as e:  # not JSON, not UTF-8, or nested past the limit
        raise FormatError(f"{where}: {TRAINER_STATE_NAME} is not valid JSON ({e})", file=file,
                          fix="the step is damaged: restore an earlier step") from None
    ok = (isinstance(record, dict) and isinstance(record.get('model'), str)
          and os.path.basename(record['model']) == record['model']
          and record['model'] not in ('', '.', '..', TRAINER_STATE_NAME, OPTIMIZER_NAME)
          and isinstance(record.get('model_namespace'), str)
          and isinstance(record.get('model_format', ''), str)
          and isinstance(record.get('metadata'), dict)
          and all(isinstance(k, str) and isinstance(v, str) for k, v in record['metadata'].items())
          and isinstance(record.get('metrics', {}), dict)
          and record.get('optimizer') in (None, OPTIMIZER_NAME))
    if not ok:
        raise FormatError(f"{where}: {TRAINER_STATE_NAME} is not a step record", file=file,
                          fix="the step is damaged: restore an earlier step")
    return record


__all__ = ['check_step_link', 'is_file', 'is_published', 'read_record', 'make_staged', 'publish_dir',
           'read_text', 'remove_staged_dir', 'write_text']
