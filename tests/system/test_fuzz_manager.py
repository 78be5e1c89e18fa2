"""A manager directory fuzzed by its parts: step names and kinds, step records, metadata and
trainer states, members, leases and leftovers of interrupted saves, read from disk and from an
in-memory bucket (``tests/system/fuzz_manager.py`` says how); and ``TrainerState.from_json``
alone. Each run is a subprocess under fuzz_formats' address-space cap and per-case watchdog."""

import json
import os
import subprocess
import sys

import pytest

from tests.system.fuzz_manager import MAKERS
from tests.system.fuzz_reader import record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCALE = float(os.environ.get("JCKPT_FUZZ_SCALE", "1"))


def _run(tmp_path, seed: int, cases: int) -> dict:
    out = tmp_path / "summary.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path), MALLOC_ARENA_MAX="2")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.system.fuzz_manager", "--cases", str(cases),
         "--seed", str(seed), "--json", str(out), "--keep", str(tmp_path / "failing"),
         "--soft-limit", "5", "--hard-limit", "60"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600 * max(1.0, SCALE))
    assert out.exists(), f"the fuzz worker died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    run = json.loads(out.read_text())["runs"][0]
    assert run["failures"] == [], json.dumps(run["failures"][:5], indent=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert run["cases"] == cases
    for fmt in MAKERS:  # not degenerate: each both reads and refuses
        assert run["outcomes"].get(f"{fmt} -> loaded", 0) > 0, (fmt, run["outcomes"])
        assert run["outcomes"].get(f"{fmt} -> refused", 0) > 0, (fmt, run["outcomes"])
    return run


def test_fuzz_manager_directory_briefly(tmp_path):
    """A short run: only reads or CheckpointErrors naming the directory, no step harmed."""
    _run(tmp_path, 35, 40)


@pytest.mark.slow
@pytest.mark.parametrize("seed", (36, 37))
def test_fuzz_manager_directory(tmp_path, seed):
    cases = max(len(MAKERS), int(2000 * SCALE))
    run = _run(tmp_path, seed, cases)
    assert run["peak_rss_growth_mib"] < 256, run["peak_rss_growth_mib"]
    record("fuzz_manager", seed=seed, cases=run["cases"], loaded=run["loaded"],
           refused=run["refused"], failures=len(run["failures"]), seconds=run["seconds"],
           slowest_case_s=run["slowest_case_s"], peak_rss_growth_mib=run["peak_rss_growth_mib"],
           outcomes=run["outcomes"])
