"""The README's main job runs and reports a bit-exact resume."""

import re
import subprocess
import sys
from pathlib import Path

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
