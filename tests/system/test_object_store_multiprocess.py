"""The directory form in an object store: 2 processes save into an S3 prefix, 2 others restore from it.

The workers are those of test_multiprocess.py (one jax.distributed run of 2
processes x 2 CPU devices); here the checkpoint is ``s3://<bucket>/ckpt`` on
the test session's S3 server: the pieces are written first, the index last.
"""

import os

import numpy as np
import pytest

from jckpt.format.names import piece_name, piece_tag
from tests.s3server import CREDENTIALS
from tests.system.test_multiprocess import check, expected, results, run_pair

pytestmark = pytest.mark.multiprocess


def test_two_processes_save_a_directory_checkpoint_to_s3(s3, s3_server):
    import jckpt
    from jckpt.storage import backend_for

    url = f"{s3}/ckpt"
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server.endpoint}
    found = check(run_pair("save", url, env))
    assert all(r["ok"] for r in found.values()), found
    names = backend_for(url).list(url)
    (tag,) = {piece_tag(n) for n in names[1:]}  # the pieces carry the save's tag
    assert names == ["index.jckpt", *sorted(piece_name(p, k, tag) for p in (0, 1) for k in (0, 1))]
    assert backend_for(s3).list(s3) == ["ckpt"]  # nothing staged beside it
    found = check(run_pair("restore", url, env))
    for r in found.values():
        assert r["ok"] and r["bytes_ok"], r
    _, tree = jckpt.load(jckpt.Context(host=True), url)
    for k in ("w", "b", "rep", "c", "loc"):
        np.testing.assert_array_equal(tree["jckpt"][k], expected(k, 1))
    assert jckpt.verify(url).ok


def test_replacing_the_checkpoint_in_s3_and_a_replacement_that_dies(s3, s3_server):
    """Saved again at the same URL, a process dies before the barrier: nothing changes; saved
    again, the new checkpoint replaces the old one and only its pieces are left."""
    import jckpt
    from jckpt.storage import backend_for, object_store

    url = f"{s3}/ckpt"
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server.endpoint}
    assert all(r["ok"] for r in check(run_pair("save", url, env)).values())
    u = object_store.ObjectURL.parse(url)
    obs, store = object_store.obstore_module(), object_store.store_for(u)

    def stored():
        return {o["path"]: bytes(obs.get(store, o["path"]).bytes())
                for chunk in obs.list(store, prefix=u.prefix) for o in chunk}

    before = stored()
    out = run_pair("die", url, {**env, "JCKPT_BARRIER_TIMEOUT": "4"}, timeout=90)
    found = results(out)
    assert 0 in found and 1 not in found, "\n\n".join(text[-3000:] for _, text, _ in out)
    assert found[0]["error_type"] == "DistributedError", found[0]
    # process 0 deleted the pieces of the failed save, its peer's too: the old checkpoint, bit for bit
    assert stored() == before
    _, tree = jckpt.load(jckpt.Context(host=True), url)
    for k in ("w", "b", "rep", "c", "loc"):
        np.testing.assert_array_equal(tree["jckpt"][k], expected(k, 1))
    (old,) = {piece_tag(os.path.basename(k)) for k in before} - {'', None}
    assert all(r["ok"] for r in check(run_pair("save", url, env)).values())
    names = backend_for(url).list(url)
    (new,) = {piece_tag(n) for n in names[1:]}
    assert new != old
    assert names == ["index.jckpt", *sorted(piece_name(p, k, new) for p in (0, 1) for k in (0, 1))]
    assert all(r["ok"] and r["bytes_ok"] for r in check(run_pair("restore", url, env)).values())
