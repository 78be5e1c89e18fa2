"""The object store backend: listing, existence and removal under a prefix, against the S3 server."""

import numpy as np
import pytest

import jckpt
from jckpt.storage import backend_for
from jckpt.storage.object_backend import OBJECT_STORE

pytest.importorskip("obstore", reason="obstore is not installed (pip install 'jckpt[cloud]')")


def test_listing_and_removal(s3):
    backend = backend_for(s3)
    for name in ("run/a.jckpt", "run/sub/b.jckpt", "other.jckpt"):
        jckpt.save(jckpt.Context(), {"x": np.zeros(2)}, f"{s3}/{name}")
    assert backend.list(s3) == ["other.jckpt", "run"]
    assert backend.list(f"{s3}/run") == ["a.jckpt", "sub"]
    assert backend.isdir(f"{s3}/run") and not backend.isdir(f"{s3}/other.jckpt")
    assert backend.exists(f"{s3}/other.jckpt") and not backend.exists(f"{s3}/run")
    one = backend.size(f"{s3}/other.jckpt")
    assert one == len(backend.map(f"{s3}/other.jckpt")) > 0
    assert backend.size(f"{s3}/run") == 2 * one and backend.size(f"{s3}/run/sub") == one
    assert backend.size(s3) == 3 * one and backend.size(f"{s3}/run/none") == 0
    backend.remove(f"{s3}/run")
    assert backend.list(s3) == ["other.jckpt"]
    backend.remove(f"{s3}/nothing")  # missing is fine


def test_whole_objects_for_the_adapters_and_their_first_bytes():
    url = "memory://backend/raw.bin"
    with OBJECT_STORE.create(url) as staging:
        staging_fd = staging.fd
        import os
        os.write(staging_fd, b"0123456789")
        staging.publish()
    assert OBJECT_STORE.map(url) == b"0123456789"
    assert OBJECT_STORE.head(url, 4) == b"0123"
    with pytest.raises(jckpt.FormatError, match="no such object"):
        OBJECT_STORE.map("memory://backend/none")


def test_an_abandoned_write_leaves_nothing():
    url = "memory://backend/abandoned.bin"
    with OBJECT_STORE.create(url) as staging:
        import os
        os.write(staging.fd, b"partial")
    assert not OBJECT_STORE.exists(url)
