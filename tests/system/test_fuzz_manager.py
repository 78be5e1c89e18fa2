"""A manager directory fuzzed by its parts: step names and kinds, step records, metadata and
trainer states, members, leases and leftovers of interrupted saves, read from disk and from an
in-memory bucket (``tests/system/fuzz_manager.py`` says how); and ``TrainerState.from_json``
alone. Each run is a subprocess under fuzz_formats' address-space cap and per-case watchdog."""

import os

import pytest

from tests.helpers import run_fuzzer
from tests.system.fuzz_manager import MAKERS
from tests.system.fuzz_reader import record

SCALE = float(os.environ.get("JCKPT_FUZZ_SCALE", "1"))


def _run(tmp_path, seed: int, cases: int) -> dict:
    run = run_fuzzer("tests.system.fuzz_manager", tmp_path, seed, cases, timeout=600 * max(1.0, SCALE))
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
