"""Developer workflows: ``nox -s tests``, ``lint``, ``typecheck``, ``docs``, ``notebooks``, ``bench``."""

import nox

nox.options.sessions = ["lint", "tests"]


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite, two workers (the size of the CI machine)."""
    session.install("-e", ".[test]")
    session.run("pytest", "-n", "2", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the package, tests, examples and benchmarks; the import contracts of the layers."""
    session.install("-e", ".[test]")
    session.run("ruff", "check", "jckpt", "tests", "examples", "bench", "noxfile.py")
    session.run("lint-imports")  # the layers (pyproject.toml, [tool.importlinter])


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy on the public API as a user calls it (the files are listed in pyproject.toml)."""
    session.install("-e", ".", "mypy")
    session.run("mypy", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site with every warning an error."""
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def notebooks(session: nox.Session) -> None:
    """Run every Colab notebook top to bottom on CPU; fails on the first error."""
    session.install("-e", ".[notebooks]")
    session.run("python", "colab/run_all.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """The comparison with orbax, safetensors, flax and numpy; writes docs/benchmarks.md.

    ``nox -s bench -- --quick --out /tmp/bench`` only checks that it runs.
    """
    session.install("-e", ".[bench]")
    session.run("python", "-m", "bench.run", *session.posargs)
