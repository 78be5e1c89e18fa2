"""The directory form in an object store: 2 processes save into an S3 prefix, 2 others restore from it.

The workers are those of test_multiprocess.py (one jax.distributed run of 2
processes x 2 CPU devices); here the checkpoint is ``s3://<bucket>/ckpt`` on
the test session's S3 server: the pieces are written first, the index last.
"""

import numpy as np
import pytest

from tests.s3server import CREDENTIALS
from tests.system.test_multiprocess import check, expected, run_pair

pytestmark = pytest.mark.multiprocess


def test_two_processes_save_a_directory_checkpoint_to_s3(s3, s3_server):
    import jckpt
    from jckpt.storage import backend_for

    url = f"{s3}/ckpt"
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server.endpoint}
    found = check(run_pair("save", url, env))
    assert all(r["ok"] for r in found.values()), found
    assert backend_for(url).list(url) == ["index.jckpt", "process_00000.1.jckpt", "process_00000.jckpt",
                                          "process_00001.1.jckpt", "process_00001.jckpt"]
    assert backend_for(s3).list(s3) == ["ckpt"]  # nothing staged beside it
    found = check(run_pair("restore", url, env))
    for r in found.values():
        assert r["ok"] and r["bytes_ok"], r
    _, tree = jckpt.load(jckpt.Context(host=True), url)
    for k in ("w", "b", "rep", "c", "loc"):
        np.testing.assert_array_equal(tree["jckpt"][k], expected(k, 1))
    assert jckpt.verify(url).ok
