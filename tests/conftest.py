"""Shared test setup: 8 virtual CPU devices, and small helpers."""

import os

# Must precede the first jax import anywhere in the test process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest


@pytest.fixture
def ctx():
    import jckpt

    return jckpt.Context()
