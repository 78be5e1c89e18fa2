"""The suite runs on any default backend: tests that build meshes ask for CPU devices by name.

`JAX_PLATFORMS=cuda,cpu pytest` makes a GPU the default backend, with one device or a few,
while the CPU keeps the 8 virtual devices conftest gives it. A test that takes its mesh
from `jax.devices()` or `jax.make_mesh(shape, names)` works on the CPU only, so these are
refused in the tests' source and in the documentation pages the tests run: use
`tests.helpers.cpu_mesh` / `cpu_devices`, or `jax.devices("cpu")`. A call that is about
the default backend on purpose carries a `# default backend` comment on its line; a
function that pins its own platform (sets `os.environ["JAX_PLATFORMS"]`, as a worker
process does) may use the default freely.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.system.test_docs import python_blocks

ROOT = Path(__file__).resolve().parents[2]
MARK = "# default backend"
_COUNTS = {"devices", "local_devices", "device_count", "local_device_count"}


def _pins_platform(fn: ast.AST) -> bool:
    """Whether a function assigns ``os.environ["JAX_PLATFORMS"]``."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if (isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
                        and t.slice.value == "JAX_PLATFORMS"):
                    return True
    return False


def _on_default_backend(call: ast.Call) -> str | None:
    """What a call asks of the default backend, or None."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    keywords = {k.arg for k in call.keywords}
    on_jax = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "jax"
    if name in _COUNTS and on_jax and not call.args and "backend" not in keywords:
        return f"jax.{name}()"
    if name == "make_mesh" and "devices" not in keywords:
        return "make_mesh without devices="
    return None


def default_backend_calls(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of each call in ``source`` that takes devices from the default backend
    without a `# default backend` comment, outside functions that pin their platform."""
    tree = ast.parse(source)
    lines = source.splitlines()
    pinned = {id(n) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and _pins_platform(fn)
              for n in ast.walk(fn)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and id(node) not in pinned:
            what = _on_default_backend(node)
            if what and MARK not in lines[node.lineno - 1]:
                found.append((node.lineno, what))
    return sorted(found)


def test_the_check_sees_default_backend_meshes():
    source = ('import jax\nm = jax.make_mesh((8,), ("x",))\nd = jax.devices()[:8]\n'
              'ok = jax.make_mesh((8,), ("x",), devices=jax.devices("cpu"))\n'
              'n = jax.device_count()  # default backend: on purpose\nsame = x.devices()\n'
              'def worker():\n    os.environ["JAX_PLATFORMS"] = "cpu"\n    jax.devices()\n')
    assert default_backend_calls(source) == [(2, "make_mesh without devices="), (3, "jax.devices()")]


@pytest.mark.parametrize("path", sorted((ROOT / "tests").rglob("*.py")), ids=lambda p: p.name)
def test_tests_ask_for_cpu_devices_by_name(path):
    found = default_backend_calls(path.read_text())
    assert not found, (f"{path.relative_to(ROOT)} takes devices from JAX's default backend at "
                       f"{found}: use tests.helpers.cpu_mesh / cpu_devices, or mark the line "
                       f"'{MARK}' when that is the point")


@pytest.mark.parametrize("path", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_doc_examples_ask_for_cpu_devices_by_name(path):
    found = [(line + at - 1, what) for line, code in python_blocks(path.read_text())
             for at, what in default_backend_calls(code)]
    assert not found, f"{path.relative_to(ROOT)} takes devices from the default backend at {found}"
