"""What a package people depend on ships: its license, its type hints, its changelog."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import jckpt

ROOT = Path(__file__).resolve().parents[2]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_file_is_the_declared_license():
    project = _project()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a pointer to it


def test_type_hints_ship():
    assert (ROOT / "jckpt" / "py.typed").is_file()
    assert "py.typed" in _project()["tool"]["setuptools"]["package-data"]["jckpt"]


def test_changelog_has_unreleased_and_the_current_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## (\S+)", text, re.M)
    assert versions[0] == "Unreleased"
    assert jckpt.__version__ in versions


def test_the_wheel_smoke_test_refuses_the_source_tree():
    """`nox -s build` runs the smoke test against the installed wheel; run here, against the
    source tree, it must fail rather than pass for the wrong package."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "system" / "smoke_installed.py"),
                          "--pure"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "imported from the source tree" in out.stderr, out.stderr


def test_the_build_session_builds_both_wheels():
    noxfile = (ROOT / "noxfile.py").read_text()
    assert 'ids=["c-extension", "pure-python"]' in noxfile
    assert "python -m nox -s build" in (ROOT / ".ci" / "run").read_text()
    assert "JCKPT_PURE_PYTHON" in (ROOT / "setup.py").read_text()


def test_the_oldest_tested_dependencies_are_the_declared_floors():
    """pyproject.toml declared jax>=0.4.35 while the library had not run on a JAX older than
    0.10 (0.4.35 saved PRNG keys under a name no JAX reads back); `nox -s oldest` now runs
    the tests on tests/oldest-deps.txt, which must pin each floor exactly."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = _project()["project"]
    floors = {}
    for spec in project["dependencies"] + project["optional-dependencies"]["cloud"]:
        req = Requirement(spec)
        (bound,) = [s for s in req.specifier if s.operator == ">="]
        floors[req.name.replace("_", "-")] = Version(bound.version)
    lines = (ROOT / "tests" / "oldest-deps.txt").read_text().splitlines()
    pins = {}
    for line in (li.split("#")[0].strip() for li in lines):
        if line:
            name, version = line.split("==")
            pins[name.replace("_", "-")] = Version(version)
    assert pins == floors
    assert "python -m nox -s oldest" in (ROOT / ".ci" / "run").read_text()


def test_the_top_level_shows_only_the_public_names_and_submodules():
    """`dir(jckpt)` (what completion offers) listed `logging`, `importlib`, `TYPE_CHECKING`."""
    import types

    import jckpt
    assert set(jckpt.__all__) <= set(dir(jckpt))
    extra = set(dir(jckpt)) - set(jckpt.__all__)
    assert extra and all(isinstance(getattr(jckpt, n), types.ModuleType) for n in extra), extra
    for name in jckpt.__all__:
        assert getattr(jckpt, name) is not None
