"""Every reader fuzzed by the structure of its format: safetensors, npy, npz, llm.c, .pth,
OCANNL files, orbax step directories and directory indexes (``tests/system/fuzz_formats.py``
says how). Two seeds of 5,000 cases each: 10,000 per run, in a subprocess under an
address-space cap and a per-case watchdog; ``JCKPT_FUZZ_SCALE`` multiplies the cases."""

import os

import pytest

from tests.helpers import run_fuzzer
from tests.system.fuzz_formats import MAKERS
from tests.system.fuzz_reader import record

SCALE = float(os.environ.get("JCKPT_FUZZ_SCALE", "1"))
SEEDS = (11, 22)
CASES_PER_SEED = max(len(MAKERS), int(5000 * SCALE))


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_every_reader(tmp_path, seed):
    """Only a correct load or a CheckpointError naming the file, per case, within the caps."""
    run = run_fuzzer("tests.system.fuzz_formats", tmp_path, seed, CASES_PER_SEED,
                     timeout=400 * max(1.0, SCALE))
    assert run["peak_rss_growth_mib"] < 256, run["peak_rss_growth_mib"]
    # Not degenerate: every format both loads (unmutated cases) and refuses.
    for fmt in MAKERS:
        assert run["outcomes"].get(f"{fmt} -> loaded", 0) > 0, (fmt, run["outcomes"])
        assert run["outcomes"].get(f"{fmt} -> refused", 0) > 0, (fmt, run["outcomes"])
    record("fuzz_formats", seed=seed, cases=run["cases"], loaded=run["loaded"],
           refused=run["refused"], failures=len(run["failures"]), seconds=run["seconds"],
           slowest_case_s=run["slowest_case_s"], peak_rss_growth_mib=run["peak_rss_growth_mib"],
           outcomes=run["outcomes"])
