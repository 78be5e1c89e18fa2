"""Every reader fuzzed by the structure of its format: safetensors, npy, npz, llm.c, .pth,
OCANNL files, orbax step directories and directory indexes (``tests/system/fuzz_formats.py``
says how). Two seeds of 5,000 cases each: 10,000 per run, in a subprocess under an
address-space cap and a per-case watchdog; ``JCKPT_FUZZ_SCALE`` multiplies the cases."""

import json
import os
import subprocess
import sys

import pytest

from tests.system.fuzz_formats import MAKERS
from tests.system.fuzz_reader import record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCALE = float(os.environ.get("JCKPT_FUZZ_SCALE", "1"))
SEEDS = (11, 22)
CASES_PER_SEED = max(len(MAKERS), int(5000 * SCALE))


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_every_reader(tmp_path, seed):
    """Only a correct load or a CheckpointError naming the file, per case, within the caps."""
    out = tmp_path / "summary.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path), MALLOC_ARENA_MAX="2")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.system.fuzz_formats", "--cases", str(CASES_PER_SEED),
         "--seed", str(seed), "--json", str(out), "--keep", str(tmp_path / "failing"),
         "--soft-limit", "5", "--hard-limit", "60"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400 * max(1.0, SCALE))
    assert out.exists(), f"the fuzz worker died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    run = json.loads(out.read_text())["runs"][0]
    assert run["failures"] == [], json.dumps(run["failures"][:5], indent=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert run["cases"] == CASES_PER_SEED
    assert run["peak_rss_growth_mib"] < 256, run["peak_rss_growth_mib"]
    # Not degenerate: every format both loads (unmutated cases) and refuses.
    for fmt in MAKERS:
        assert run["outcomes"].get(f"{fmt} -> loaded", 0) > 0, (fmt, run["outcomes"])
        assert run["outcomes"].get(f"{fmt} -> refused", 0) > 0, (fmt, run["outcomes"])
    record("fuzz_formats", seed=seed, cases=run["cases"], loaded=run["loaded"],
           refused=run["refused"], failures=len(run["failures"]), seconds=run["seconds"],
           slowest_case_s=run["slowest_case_s"], peak_rss_growth_mib=run["peak_rss_growth_mib"],
           outcomes=run["outcomes"])
