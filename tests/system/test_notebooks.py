"""The Colab notebooks are well-formed: badge, install cell, no stored outputs, no downloads.

Running them is ``python colab/run_all.py`` (``nox -s notebooks``, and CI), which
executes every notebook top to bottom; these checks are the cheap part that
every test run does.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

COLAB = Path(__file__).resolve().parents[2] / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
_URL = re.compile(r"https?://")


def test_there_are_notebooks():
    names = {p.stem for p in NOTEBOOKS}
    assert {"quickstart", "model_surgery", "sharded_restore", "async_mirror", "interop", "nnx"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_shape(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    first, install = nb.cells[0], nb.cells[1]
    badge = f"https://colab.research.google.com/github/jckpt-dev/jckpt/blob/main/colab/{path.name}"
    assert first.cell_type == "markdown" and badge in first.source, "the first cell is the badge"
    assert install.cell_type == "code"
    assert 'find_spec("jckpt") is None' in install.source, "the install cell skips when importable"
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        assert not cell.get("outputs") and cell.get("execution_count") is None, \
            "notebooks are stored without outputs"
        if cell is not install:
            assert not _URL.search(cell.source), "no downloads outside the install cell"


def test_readme_lists_every_notebook():
    readme = (COLAB / "README.md").read_text()
    for path in NOTEBOOKS:
        assert f"({path.name})" in readme, f"{path.name} is missing from colab/README.md"
