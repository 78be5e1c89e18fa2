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


def _put(url, data=b"x"):
    import obstore

    from jckpt.storage.object_store import ObjectURL, store_for
    u = ObjectURL.parse(url)
    obstore.put(store_for(u), u.key, data)


def _keys(url):
    import obstore

    from jckpt.storage.object_store import ObjectURL, store_for
    u = ObjectURL.parse(url)
    return sorted(o["path"] for chunk in obstore.list(store_for(u), prefix=u.prefix) for o in chunk)


def test_remove_all_removes_what_is_below_each_path_and_nothing_beside_it():
    """The prefixes are listed together, from the first to the last: what lies between them
    (a step kept between two removed, a name that only starts like one) stays."""
    root = "memory://remove-all/run"
    names = ["s1/a", "s1/b/c", "s1", "s10/a", "s1-next.0", "s2/a", "s3/a", "s3/z", "s4/a"]
    for name in names:
        _put(f"{root}/{name}")
    OBJECT_STORE.remove_all([f"{root}/s3", f"{root}/s1"])
    assert _keys(root) == ["run/s1-next.0", "run/s10/a", "run/s2/a", "run/s4/a"]
    OBJECT_STORE.remove_all([f"{root}/s2/a", f"{root}/s4"], below=False)  # the objects alone
    assert _keys(root) == ["run/s1-next.0", "run/s10/a", "run/s4/a"]
    OBJECT_STORE.remove_all([])


def test_a_failed_removal_names_the_keys_it_was_deleting(monkeypatch):
    import obstore

    root = "memory://remove-fails/run"
    for n in range(5):
        _put(f"{root}/step_{n}")

    def delete(store, paths):
        raise ConnectionError("connection reset by peer")
    monkeypatch.setattr(obstore, "delete", delete)
    with pytest.raises(jckpt.StorageError, match="deleting run/step_0, run/step_1, run/step_2 and 2 "
                                                 "more failed: connection reset") as e:
        OBJECT_STORE.remove_all([f"{root}/step_{n}" for n in range(5)], below=False)
    assert e.value.file == "memory://remove-fails/run/step_0"


def test_remove_all_deletes_a_thousand_keys_a_request(monkeypatch):
    import obstore

    from jckpt.storage.object_backend import DELETE_BATCH
    root = "memory://remove-many/run"
    for n in range(DELETE_BATCH + 5):
        _put(f"{root}/d/{n:05d}")
    real, sizes = obstore.delete, []
    monkeypatch.setattr(obstore, "delete", lambda store, paths: (sizes.append(len(paths)),
                                                                 real(store, paths))[1])
    OBJECT_STORE.remove(f"{root}/d")
    assert sizes == [DELETE_BATCH, 6] and _keys(root) == []
