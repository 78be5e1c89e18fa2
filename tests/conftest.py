"""Shared test setup: 8 virtual CPU devices, and small helpers."""

import os

# Must precede the first jax import anywhere in the test process. The CPU gets 8 devices even
# when XLA_FLAGS carries other flags; JAX_PLATFORMS=cuda,cpu keeps a GPU as the default backend,
# and the tests that build meshes ask for CPU devices by platform (tests/helpers.py, cpu_mesh).
_EIGHT = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_EIGHT}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture
def ctx():
    import jckpt

    return jckpt.Context()
