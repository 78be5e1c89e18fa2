"""Every code example in the documentation (and the README) runs, and every docstring example passes.

Each page's ```python blocks are run in order, in one namespace, in a fresh
temporary directory (so a page reads as one session), and what a block's comments say
its prints show (`print(x)  # [1, 2]`) must appear in what it printed. ```console blocks run
there too, in the same order: each ``$ command`` line is run by the shell
(``jckpt`` meaning this interpreter's ``python -m jckpt``), must exit 0 (or
the status its ``# exit N`` comment says), and every output line shown under it
(other than ``...``) must appear in what it printed, up to spacing. A block
preceded by an HTML comment ``<!-- not-run: reason -->`` is shown but not run
(for example a script meant for several processes); the reason is required.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import io
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
_NOT_RUN = re.compile(r"<!--\s*not-run:\s*(?P<reason>\S[^>]*?)\s*-->\s*\Z")

# Optional extras: a module that needs one of these is skipped when it is missing.
_OPTIONAL = {"orbax", "torch", "safetensors", "flax", "matplotlib", "rich", "psutil", "optax",
             "equinox"}


def doc_blocks(text: str) -> list[tuple[int, str, str]]:
    """``(line, kind, body)`` of each runnable ```python or ```console block of a page."""
    blocks = []
    for m in _FENCE.finditer(text):
        info = m.group("info").strip().split()
        if not info or info[0] not in ("python", "py", "console"):
            continue
        if _NOT_RUN.search(text[:m.start()].rstrip()[-300:]):
            continue
        line = text.count("\n", 0, m.start()) + 2
        blocks.append((line, "console" if info[0] == "console" else "python", m.group("body")))
    return blocks


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each runnable ```python block of a Markdown page."""
    return [(line, body) for line, kind, body in doc_blocks(text) if kind == "python"]


_EXIT = re.compile(r"\s#\s*exit\s+(\d+)\s*\Z")


def console_commands(body: str) -> list[tuple[str, int, list[str]]]:
    """``(command, expected exit status, expected output lines)`` of a console block."""
    commands: list[tuple[str, int, list[str]]] = []
    for raw in body.splitlines():
        if raw.startswith("$ "):
            command = raw[2:].strip()
            status = 0
            m = _EXIT.search(command)
            if m:
                status = int(m.group(1))
                command = command[:m.start()].rstrip()
            commands.append((command, status, []))
        elif commands and raw.strip() and raw.strip() != "...":
            commands[-1][2].append(raw)
    return commands


def _squash(text: str) -> str:
    return " ".join(text.split())


def run_console(body: str, where: str, cwd: Path) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu", COLUMNS="120")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for command, status, expected in console_commands(body):
        shell = re.sub(r"(^|[|;&]\s*)jckpt\b", lambda m: m.group(1) + f"{sys.executable} -m jckpt",
                       command)
        out = subprocess.run(["bash", "-c", shell], cwd=cwd, env=env, capture_output=True,
                             text=True, timeout=300)
        printed = out.stdout + out.stderr
        assert out.returncode == status, (f"{where}: `{command}` exited {out.returncode}, the page "
                                          f"says {status}\n{printed}")
        squashed = _squash(printed)
        for line in expected:
            assert _squash(line) in squashed, (f"{where}: `{command}` did not print\n  {line}\n"
                                               f"it printed:\n{printed}")


def expected_prints(code: str) -> list[str]:
    """What a ```python block says its prints show: the comment after a `print(...)` line,
    or the comment lines right under it (joined), as in `print(err)` then `# m.jckpt: ...`."""
    lines = code.splitlines()
    expected = []
    for i, line in enumerate(lines):
        if "print(" not in line.split("#", 1)[0]:
            continue
        m = re.search(r"\)\s+#\s?(.*)$", line)
        if m:
            expected.append(m.group(1).strip())
            continue
        below = []
        for following in lines[i + 1:]:
            if not following.strip().startswith("#"):
                break
            below.append(following.strip().lstrip("#").strip())
        if below:
            expected.append(" ".join(below))
    return expected


def missing_prints(code: str, printed: str) -> list[str]:
    """The expected prints of `code` that `printed` lacks, up to spacing. `...` elides, and a
    fragment may carry a note after `: ` (`[0. 1. 2.]: the old bytes`)."""
    out = _squash(printed)
    missing = []
    for text in expected_prints(code):
        for fragment in filter(None, re.split(r"\s*\.\.\.\s*", text)):
            if _squash(fragment) not in out and _squash(fragment.split(": ", 1)[0]) not in out:
                missing.append(text)
                break
    return missing


def _pages() -> list[Path]:
    return [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]


def test_block_extraction():
    text = ("intro\n```python\nx = 1\n```\n\n```bash\nls\n```\n"
            "<!-- not-run: needs two processes -->\n```python\nboom()\n```\n"
            "```python title=\"t.py\"\ny = x + 1\n```\n"
            "```console\n$ jckpt verify a.jckpt  # exit 1\nFAILED: a\n...\n$ ls\n```\n")
    assert python_blocks(text) == [(3, "x = 1\n"), (14, "y = x + 1\n")]
    (_, _kind, body), = [b for b in doc_blocks(text) if b[1] == "console"]
    assert console_commands(body) == [("jckpt verify a.jckpt", 1, ["FAILED: a"]), ("ls", 0, [])]


def test_expected_prints_are_read_from_comments():
    code = ("print(x)   # [1, 2]\nprint(y)\n# a: b\n#   (fix: c)\nz = 1  # not a print\n"
            "print(w)  # [0. 1.]: the old bytes\nprint(v)  # one ... two\n")
    assert expected_prints(code) == ["[1, 2]", "a: b (fix: c)", "[0. 1.]: the old bytes", "one ... two"]
    assert missing_prints(code, "[1, 2]\na: b\n (fix: c)\n[0. 1.]\none, and two") == []
    assert missing_prints(code, "[1, 3]\na: b (fix: c)\n[0. 1.]\none two") == ["[1, 2]"]


def test_docs_have_examples():
    runnable = {p.name for p in _pages() if python_blocks(p.read_text())}
    for name in ("index.md", "getting-started.md", "concepts.md", "recipes.md"):
        assert name in runnable


def _work_in(folder: Path, monkeypatch) -> None:
    """Run examples in ``folder``, their ``tempfile.mkdtemp()`` folders too (none left behind)."""
    monkeypatch.chdir(folder)
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_page_examples_run(page: Path, tmp_path, monkeypatch):
    blocks = doc_blocks(page.read_text())
    if not blocks:
        pytest.skip(f"{page.name} has no examples")
    _work_in(tmp_path, monkeypatch)
    namespace: dict = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for line, kind, code in blocks:
        if kind == "console":
            run_console(code, f"docs/{page.name}:{line}", tmp_path)
            continue
        compiled = compile(code, f"{page.name}:{line}", "exec")
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                exec(compiled, namespace)
        except ModuleNotFoundError as err:
            if err.name and err.name.split(".")[0] in _OPTIONAL:
                pytest.skip(f"{page.name}:{line} needs {err.name}")
            raise
        except Exception as err:
            raise AssertionError(f"example at docs/{page.name}:{line} failed: {err!r}\n"
                                 f"{code}\n--- its output ---\n{out.getvalue()}") from err
        missing = missing_prints(code, out.getvalue())
        assert not missing, (f"example at docs/{page.name}:{line} did not print what its comments "
                             f"say: {missing}\n--- its output ---\n{out.getvalue()}")


def _modules() -> list[str]:
    import jckpt

    names = ["jckpt"]
    for info in pkgutil.walk_packages(jckpt.__path__, "jckpt."):
        names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_module_doctests(name: str, tmp_path, monkeypatch):
    """The ``>>>`` examples in docstrings (the API reference shows them) pass."""
    _work_in(tmp_path, monkeypatch)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in _OPTIONAL:
            pytest.skip(f"{name} needs {err.name}")
        raise
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for test in finder.find(module, name, globs=dict(vars(module))):
            if test.filename and Path(test.filename).resolve() != Path(module.__file__).resolve():
                continue
            runner.run(test, out=out.write)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, out.getvalue()


def test_typecheck_api_file_runs(tmp_path, monkeypatch):
    """The file the type check reads is real code: it runs."""
    import runpy

    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        runpy.run_path(str(ROOT / "tests" / "system" / "typecheck_api.py"), run_name="__main__")


# reStructuredText the API reference (mkdocstrings, Google style, Markdown) shows literally.
_REST = re.compile(r":(?:class|func|meth|data|mod|attr|exc|obj):`|(?<!`)``(?!`)|::\n|^\s*={3,}  +=", re.M)


def _api_objects() -> list[tuple[str, tuple[str, ...]]]:
    """``(dotted name, inherited members shown)`` of each ``:::`` line of docs/api.md."""
    lines = (DOCS / "api.md").read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith(":::"):
            options = "\n".join(lines[i + 1:i + 4])
            m = re.search(r"inherited_members:\s*\[([^\]]*)\]", options)
            found.append((line[3:].strip(), tuple(x.strip() for x in m.group(1).split(",")) if m else ()))
    return found


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise AssertionError(f"docs/api.md lists {dotted}, which does not import")


def _shown_docstrings(obj, name: str, inherited: tuple[str, ...] = ()) -> list[tuple[str, str | None]]:
    """The docstrings the reference shows for ``obj``: its own, its members', the inherited ones listed."""
    import inspect

    shown = [(name, obj.__doc__ if inspect.ismodule(obj) else inspect.getdoc(obj))]
    if inspect.ismodule(obj):
        for key, value in vars(obj).items():
            if not key.startswith("_") and getattr(value, "__module__", None) == obj.__name__:
                shown += _shown_docstrings(value, f"{name}.{key}")
    elif inspect.isclass(obj):
        for key, value in vars(obj).items():
            if key.startswith("_") and key != "__init__":
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if callable(value) or isinstance(value, property):
                shown.append((f"{name}.{key}", value.__doc__))
        shown += [(f"{name}.{key}", inspect.getdoc(getattr(obj, key))) for key in inherited]
    return shown


def test_api_reference_lists_every_public_name():
    """Each name of `jckpt.__all__` is in docs/api.md, as itself or as a member of a module
    listed whole (the errors), and every object listed there imports."""
    import jckpt

    shown = set()
    for dotted, _ in _api_objects():
        obj = _resolve(dotted)
        shown.add(id(obj))
        if isinstance(obj, type(jckpt)):
            shown.update(id(v) for k, v in vars(obj).items() if not k.startswith("_"))
    missing = [name for name in jckpt.__all__
               if name != "__version__" and id(getattr(jckpt, name)) not in shown]
    assert missing == [], f"docs/api.md does not document {missing}"


@pytest.mark.parametrize("dotted, inherited", _api_objects(), ids=lambda v: v if isinstance(v, str) else "")
def test_api_reference_docstrings_are_markdown(dotted: str, inherited: tuple[str, ...]):
    """The reference renders Google-style Markdown: no reST roles, double backticks or ``::`` blocks."""
    try:
        obj = _resolve(dotted)
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in _OPTIONAL:
            pytest.skip(f"{dotted} needs {err.name}")
        raise
    leftovers = [(name, m.group(0)) for name, doc in _shown_docstrings(obj, dotted, inherited)
                 for m in [_REST.search(doc or "")] if m]
    assert not leftovers, f"reStructuredText the API reference would show literally: {leftovers}"


def _source_docstrings(path: Path) -> list[tuple[str, str]]:
    """``(file:line name, docstring)`` of the module and of every class and function in it,
    private and nested ones included (read from the source: nothing is imported)."""
    import ast

    tree = ast.parse(path.read_text())
    where = path.relative_to(ROOT)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                name = getattr(node, "name", "<module>")
                found.append((f"{where}:{getattr(node, 'lineno', 1)} {name}", doc))
    return found


def test_every_docstring_is_markdown():
    """Not only the API reference: every docstring of the package is Google style with Markdown
    (help(), editors' hovers and the source read the same as the site)."""
    leftovers = [(where, m.group(0)) for path in sorted((ROOT / "jckpt").rglob("*.py"))
                 for where, doc in _source_docstrings(path) for m in [_REST.search(doc)] if m]
    assert not leftovers, f"reStructuredText in docstrings ({len(leftovers)}): {leftovers[:20]}"


def test_source_docstrings_are_all_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "m.py").write_text('"""Mod ``x``."""\nclass A:\n    def _f(self):\n'
                                   '        """See :class:`B`."""\n')
    docs = dict(_source_docstrings(tmp_path / "m.py"))
    assert docs == {"m.py:1 <module>": "Mod ``x``.", "m.py:3 _f": "See :class:`B`."}


def test_rest_leftovers_are_found():
    for bad in (":class:`~jckpt.errors.InputError`", "``x``", "Example::\n\n    f()", ":func:`f`",
                "=====  =====\na      b\n=====  ====="):
        assert _REST.search(bad), bad
    assert not _REST.search("Example:\n    ```python\n    f(`x`)\n    ```\n")
