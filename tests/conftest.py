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


@pytest.fixture(autouse=True)
def _no_header_lengths_remembered():
    """Each test starts with no header length remembered from another's object
    (`jckpt.storage.remote_reader.header_guess`): a test counts its own reads."""
    import sys

    reader = sys.modules.get("jckpt.storage.remote_reader")
    if reader is not None:
        reader._SEEN.clear()
    yield


@pytest.fixture
def ctx():
    import jckpt

    return jckpt.Context()


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server for this test process, on a free port (stopped at the end)."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'jckpt[test]')")
    pytest.importorskip("obstore", reason="obstore is not installed (pip install 'jckpt[cloud]')")
    from tests.s3server import S3Server

    server = S3Server.start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A fresh bucket on the S3 server, the environment pointing at it: yields ``'s3://<bucket>'``."""
    from jckpt.storage import object_store
    from tests.s3server import CREDENTIALS

    for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server.endpoint}.items():
        monkeypatch.setenv(name, value)
    object_store.forget_stores()
    yield f"s3://{s3_server.bucket()}"
    object_store.forget_stores()


@pytest.fixture
def slow_s3(s3, s3_server):
    """`(bucket URL, proxy)`: the bucket reached through a `FaultProxy` that answers each request
    `proxy.delay` seconds late (0.05, as a real bucket's latency; 0 to fill a bucket quickly),
    counting what was in flight at once (`proxy.most_in_flight`, `proxy.rounds()`)."""
    from jckpt.storage import object_store
    from tests.s3server import FaultProxy

    proxy = FaultProxy(s3_server.endpoint, delay=0.05)
    object_store.configure(s3, endpoint=proxy.endpoint)
    try:
        yield s3, proxy
    finally:
        object_store.configure(s3)
        proxy.close()
