"""Every reader under mutation, each case in a process of its own (``tests/system/fuzz_hostile.py``
says how): no crash, hang, memory blow-up, or error other than a CheckpointError naming the
case. 600 cases a run (50 a family); ``JCKPT_FUZZ_SCALE`` multiplies them. Every mutator
runs, ``amplify`` too (an item repeated up to 400,000 times: headers of tens of MB, which
the readers refuse with a linear scan, ``jckpt.format.prescan``); longer runs by hand:
``python -m tests.system.fuzz_hostile --cases 3000``."""

import json
import os
import subprocess
import sys

import pytest

from tests.system.fuzz_hostile import FAMILIES
from tests.system.fuzz_reader import record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCALE = float(os.environ.get("JCKPT_FUZZ_SCALE", "1"))
CASES = max(len(FAMILIES), int(50 * len(FAMILIES) * SCALE))


@pytest.mark.slow
def test_mutated_files_of_every_family_are_read_or_refused_in_bounds(tmp_path):
    out = tmp_path / "summary.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path), MALLOC_ARENA_MAX="2")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.system.fuzz_hostile", "--cases", str(CASES), "--seed", "3",
         "--json", str(out), "--keep", str(tmp_path / "failing"), "--timeout", "60",
         "--slow", "20"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900 * max(1.0, SCALE))
    assert out.exists(), f"the fuzzer died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    run = json.loads(out.read_text())
    assert run["defects"] == {}, json.dumps(run["defects"], indent=1)[:6000]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert run["cases"] == CASES
    # Not degenerate: every family written, read unmutated and refused mutated.
    assert set(run["families"]) == set(FAMILIES) - set(run["skipped_families"])
    for family, outcomes in run["families"].items():
        assert outcomes.get("refused", 0) > 0, (family, outcomes)
        if family != "torch_legacy":  # jckpt reads torch's zip format only
            assert outcomes.get("ok", 0) > 0, (family, outcomes)
    record("fuzz_hostile", seed=3, cases=run["cases"], outcomes=run["outcomes"],
           seconds=run["seconds"], slowest_case_s=run["slowest_case_s"])


_SMALL_RUN = """
import json, os, sys, tempfile
from tests.system import fuzz_hostile as fh
work = tempfile.mkdtemp()
os.makedirs(os.path.join(work, "corpus", "native"))
from tests.helpers import write_arrays  # no JAX runtime: a fork would lose its threads
write_arrays(os.path.join(work, "corpus", "native", "c.jckpt"), fh._tree())
fh._warm(os.path.join(work, "corpus"))
print(json.dumps(fh.run(5, 6, os.path.join(work, "corpus"), work, timeout=60,
                        rss_limit_mib=256, keep=None)))
"""


@pytest.mark.slow
def test_memory_is_measured_beyond_what_the_unmutated_sample_costs(tmp_path):
    """A forked child's growth counted the interpreter's and libraries' pages it faults in
    again, which no reader allocates, against a limit stated as the readers': the figure is
    now the growth beyond the family's unmutated sample's, and both are in the summary."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _SMALL_RUN], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0 < run["baseline_rss_mib"]["native"] < 64, run["baseline_rss_mib"]
    largest = run["largest_rss_growth"]
    assert largest["rss_mib"] < 256 and run["defects"] == {}, run
