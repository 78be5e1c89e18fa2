"""Fixtures of the trees tests."""

import pytest

from jckpt.trees import facts, to_host


@pytest.fixture
def accelerator(monkeypatch):
    """Every sharding taken for one whose devices are not the CPU's (data to transfer), so the
    CPU runs the transfers, pinned copies and joins an accelerator's arrays take."""
    real = facts.of
    monkeypatch.setattr(to_host, "ACCELERATE", False)  # C stages only arrays known on the CPU
    monkeypatch.setattr(facts, "of", lambda sharding: real(sharding)._replace(on_cpu=False))
