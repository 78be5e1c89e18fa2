"""The counters' one-line summary and how they name an error."""

import dataclasses

import pytest

from jckpt.errors import StorageError
from jckpt.services.counters import MirrorCounters, error_code, kept_error


def test_the_summary_names_the_five_counters_in_order():
    c = MirrorCounters(committed=5, durable=4, generation=9, pending=1, error='ENOSPC', images=5)
    assert str(c) == "memory mirror: committed 5 durable 4 generation 9 pending 1 error ENOSPC"


def test_a_reading_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MirrorCounters().committed = 1


@pytest.mark.parametrize("exc, code", [
    (OSError(28, "full"), "ENOSPC"), (PermissionError(13, "no"), "EACCES"),
    (StorageError("gone"), "StorageError"), (ValueError("x"), "ValueError"),
    (OSError(99999, "odd"), "OSError")])
def test_an_error_is_named_by_its_errno_or_its_class(exc, code):
    assert error_code(exc) == code


def test_a_kept_snapshots_error_says_it_is_retried_and_leaves_the_writers_record_alone():
    error = StorageError("writing failed", errno=28, file="f.jckpt", fix="free disk space, then save again")
    kept = kept_error(error)
    assert kept.fix.startswith("free disk space: the snapshot is kept and retried")
    assert str(kept).startswith("f.jckpt: writing failed") and kept.errno == 28
    assert error.fix == "free disk space, then save again"
    other = OSError(28, "No space left on device")
    assert kept_error(other) is other
