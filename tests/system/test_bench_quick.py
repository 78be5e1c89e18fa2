"""The benchmark suite runs end to end in quick mode (its figures are not checked: speed
goals live in ``bench/``, measured as ratios, not in unit tests)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_suite_writes_the_report(tmp_path):
    out = tmp_path / "docs"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's run has
    cmd = [sys.executable, "-m", "bench.run", "--quick", "--workloads", "small,tiny,gpt2",
           "--out", str(out), "--json", str(tmp_path / "r.json"), "--dir", str(tmp_path / "files")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    results = json.loads((tmp_path / "r.json").read_text())
    for name, res in results["workloads"].items():
        jk = res["runs"]["jckpt"]
        assert len(jk) == 1, name
        for op in ("save", "durable_save", "load_host", "restore", "first_use"):
            assert jk[0][op] > 0, (name, op)
        assert res["runs"]["raw"], name
        assert "jckpt" not in res.get("notes", {}), res["notes"]  # jckpt never failed
        rss = res["rss"]["jckpt"]
        assert rss.get("restore_peak", -1) >= 0, rss
    md = (out / "benchmarks.md").read_text()
    assert "| jckpt |" in md and "## Targets" in md
    assert not os.listdir(tmp_path / "files")  # every file cleaned up


@pytest.mark.slow
def test_gpu_benchmark_runs_on_the_default_device_in_quick_mode(tmp_path):
    """`bench.gpu` (restore, copy limits, blocking of asynchronous checkpoints) runs on the
    CPU too, and jckpt's restores and checkpoints in it succeed."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "bench.gpu", "--quick", "--reps", "1", "--small", "100",
           "--json", str(tmp_path / "gpu.json"), "--dir", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["machine"]["platform"] == "cpu"
    assert result["limits"]["host-to-device"]["ms"] > 0
    assert set(result["restore"]) == {"64 MiB random", "100 small arrays"}
    for row in result["restore"].values():
        assert row["jckpt"]["ms"] > 0 and row["raw"]["ms"] > 0, row
    runs = result["blocking"]["runs"]
    for name in ("mirror", "manager"):
        assert len(runs[name]["blocks_ms"]) == 3 and runs[name]["counters"].endswith("error 0"), runs
    assert "| mirror |" in p.stdout and "| restore onto the device |" in p.stdout
    assert os.listdir(tmp_path) == ["gpu.json"]  # every file cleaned up


def test_index_scale_benchmark_runs_its_smallest_size():
    """The directory-index benchmark writes, indexes, reads and plans 1,025 pieces."""
    p = subprocess.run([sys.executable, "bench/bench_index_scale.py", "--sizes", "1k"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    header, row = p.stdout.splitlines()[:2]
    assert "plan one" in header and row.split()[0] == "1025"


def test_small_save_benchmark_times_every_writer_with_and_without_c():
    from bench import small_save
    from jckpt.trees import to_host

    for python in (False, True):
        medians = small_save.main(reps=1, python=python)
        assert set(medians) == {'jckpt save', 'safetensors save', 'raw write', 'jckpt durable save',
                                'raw write + fsync'} and all(t > 0 for t in medians.values())
    assert to_host.ACCELERATE  # the switches are back


def test_the_benchmarks_page_is_what_its_results_and_notes_make(tmp_path):
    """docs/benchmarks.md is written by `bench.run --from-json bench/comparison-results.json
    --out docs`: no section of it lives only in the page, where a rewrite would lose it."""
    from bench import report
    results = json.loads(open(os.path.join(ROOT, "bench", "comparison-results.json")).read())
    written = report.write(results, str(tmp_path))
    page = open(os.path.join(ROOT, "docs", "benchmarks.md")).read().splitlines()
    made = open(written).read().splitlines()
    if not any(x.startswith("![") for x in made):  # no matplotlib: no plot, an empty line
        page = [x for x in page if not x.startswith("![")]
    assert [x for x in made if x.strip()] == [x for x in page if x.strip()]
