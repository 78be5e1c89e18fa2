"""Background writers left open are closed at the interpreter's exit, never in a forked child."""

import os
import textwrap

import numpy as np
import pytest

import jckpt
from tests.helpers import run_python

EXIT_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import jckpt
    m = jckpt.Mirror(sys.argv[1])
    for i in range(5):
        m.submit({"w": np.full(4, i, np.float32)})
    # no close: the interpreter's exit flushes what was admitted
""")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_mirror_left_open_is_flushed_at_exit(tmp_path):
    path = str(tmp_path / "run.jckpt")
    out = run_python(EXIT_CHILD, path)
    assert out.returncode == 0, out.stderr
    restored = jckpt.restore(jckpt.Context(), {"w": np.zeros(4, np.float32)}, path, verify=True)
    np.testing.assert_array_equal(restored["w"], np.full(4, 4))
    assert jckpt.describe(path).metadata_dict()["jckpt.generation"] == "5"
    assert sorted(os.listdir(tmp_path)) == ["run.jckpt"]   # lease released, nothing staged left


def test_a_forked_child_does_not_close_its_parents_mirror_at_exit(tmp_path):
    script = textwrap.dedent(f'''
        import os, numpy as np, jckpt
        m = jckpt.Mirror({str(tmp_path / 'run.jckpt')!r})
        m.submit({{'w': np.ones(3)}})
        assert m.wait_durable(timeout=30)
        pid = os.fork()
        if pid == 0:
            raise SystemExit(0)  # a normal exit: atexit runs in the child
        assert os.waitpid(pid, 0)[1] == 0
        try:
            jckpt.Mirror({str(tmp_path / 'run.jckpt')!r})
        except jckpt.InUseError:
            print('refused')
        m.close()
    ''')
    out = run_python(script)
    assert out.returncode == 0 and out.stdout.strip() == 'refused', out.stderr[-2000:]
