"""The counters' one-line summary and how they name an error."""

import dataclasses

import pytest

from jckpt.errors import StorageError
from jckpt.services.counters import MirrorCounters, error_code


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
