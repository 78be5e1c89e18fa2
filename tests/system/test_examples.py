"""The README's main job runs and reports a bit-exact resume."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_train_resume_example():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_resume.py"),
                          "--steps", "40", "--every", "10", "--crash-at", "27"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "matches the uninterrupted run bit for bit: True" in out.stdout
    assert "last checkpoint: step 20" in out.stdout and "resuming from step 20" in out.stdout
    counters = re.findall(r"^memory mirror: committed (\d+) durable (\d+) generation (\d+) "
                          r"pending (\d+) error (\S+)$", out.stdout, re.MULTILINE)
    # Two saves before the interruption (10, 20), then 30 and 40 after resuming.
    assert counters == [("2", "2", "2", "0", "0"), ("2", "2", "4", "0", "0")], out.stdout


def test_gpt2_llmc_example():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt2_llmc.py"),
                          "--steps", "30", "--every", "10", "--crash-at", "17"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert ("last checkpoint: step 10: ['model.bin', 'optimizer.jckpt', 'trainer_state.json']"
            in out.stdout), out.stdout
    assert "model.bin is byte-identical to the llmc writer's file: True" in out.stdout
    assert "matches the uninterrupted run bit for bit: True" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("example", ["train_resume.py", "train_gpt2_llmc.py"])
def test_an_example_interrupted_before_its_first_save_starts_again(example):
    """Its resume restored from a directory of no step and failed: a job copied from it could
    not start again after being stopped before its first checkpoint."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / example),
                          "--steps", "20", "--every", "10", "--crash-at", "5"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "no checkpoint yet: starting from step 0" in out.stdout, out.stdout
    assert "matches the uninterrupted run bit for bit: True" in out.stdout
