"""The README's main job runs and reports a bit-exact resume."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_train_resume_example():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_resume.py"),
                          "--steps", "40", "--every", "10", "--crash-at", "27"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "matches the uninterrupted run bit for bit: True" in out.stdout
