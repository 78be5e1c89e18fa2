"""The layout is the architecture: no import cycles, readable functions and modules.

The layer contracts themselves are checked by ``lint-imports`` (``pyproject.toml``,
``[tool.importlinter]``); this test adds what import-linter does not: no cycles
among modules at all (imports inside functions included), and sizes that fit on
a screen. See docs/design.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / 'jckpt'
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500
#: Functions allowed past the limit: declarative tables, long by nature (none today).
LONG_TABLES: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for f in PACKAGE.rglob('*.py'):
        parts = f.relative_to(PACKAGE.parent).with_suffix('').parts
        out['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = f
    return out


MODULES = _modules()
#: Compiled extension modules (no source to parse): leaves of the import graph.
EXTENSIONS = {'.'.join(f.relative_to(PACKAGE.parent).with_suffix('').parts)
              for f in PACKAGE.rglob('*.c')}


def _resolve(name: str) -> str | None:
    while name and name not in MODULES and name not in EXTENSIONS:
        name = name.rpartition('.')[0]
    return name if name in MODULES else None


def _imports(module: str, path: Path) -> set[str]:
    """Every jckpt module ``module`` imports, wherever the import statement sits."""
    package = module if path.name == '__init__.py' else module.rpartition('.')[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ''
            if node.level:
                parts = package.split('.')[:len(package.split('.')) - node.level + 1]
                base = '.'.join(parts + ([base] if base else []))
            names = [f'{base}.{a.name}' for a in node.names] + [base]
        else:
            continue
        for name in names:
            target = _resolve(name) if name.startswith('jckpt') else None
            if target is not None and target != module:
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = {m: _imports(m, p) for m, p in MODULES.items()}
    # a package's __init__ that only re-exports its own modules is not a cycle with them
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + '.')}
    assert _cycles(graph) == []


def test_the_codec_imports_only_itself_the_errors_and_the_version():
    for m, p in MODULES.items():
        if m.startswith('jckpt.format'):
            outside = {t for t in _imports(m, p) if not t.startswith('jckpt.format')}
            assert outside <= {'jckpt.errors', 'jckpt.version'}, (m, outside)


@pytest.mark.parametrize('module', sorted(MODULES))
def test_functions_and_modules_fit_on_a_screen(module: str):
    source = MODULES[module].read_text()
    assert source.count('\n') <= MAX_MODULE_LINES, f"{module} has {source.count(chr(10))} lines"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if (module, node.name) not in LONG_TABLES:
                assert length <= MAX_FUNCTION_LINES, f"{module}.{node.name} is {length} lines"


TESTS = PACKAGE.parent / 'tests'
#: Modules whose tests live in a test module of another name (the codec's round trips are
#: tested together; the multi-process save needs several processes, a system test).
COVERED_BY = {
    'jckpt.format.header': 'format/test_codec.py',
    'jckpt.format.layout': 'format/test_codec.py',
    'jckpt.format.payload': 'format/test_codec.py',
    'jckpt.format.precs': 'format/test_codec.py',
    'jckpt.format.entries': 'format/test_codec.py',
    'jckpt.format.fastpath': 'format/test_codec.py',
    'jckpt.api.saving': 'api/test_api.py',
    'jckpt.api.loading': 'api/test_api.py',
    'jckpt.api.multiprocess': 'system/test_multiprocess.py',
    'jckpt.adapters.orbax': 'adapters/test_orbax.py',
    'jckpt.adapters.orbax_handler': 'adapters/test_orbax.py',
    'jckpt.adapters.orbax_writer': 'adapters/test_orbax.py',
}


def _own_test(module: str) -> Path | None:
    """Where ``jckpt.<layer>.<name>``'s tests are: ``tests/<layer>/test_<name>.py``."""
    if module in COVERED_BY:
        return TESTS / COVERED_BY[module]
    parts = module.split('.')
    if len(parts) != 3 or parts[2].startswith('__'):
        return None  # the root package's modules, and packages' __init__
    return TESTS / parts[1] / f"test_{parts[2].lstrip('_')}.py"


@pytest.mark.parametrize('module', sorted(MODULES))
def test_every_module_has_a_test_module(module: str):
    expected = _own_test(module)
    if expected is not None:
        assert expected.is_file(), f"{module} has no test module {expected.relative_to(TESTS)}"
