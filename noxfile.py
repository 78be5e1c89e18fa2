"""Developer workflows: ``nox -s tests``, ``nox -s lint``."""

import nox

nox.options.sessions = ["lint", "tests"]


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite, two workers (the size of the CI machine)."""
    session.install("-e", ".[test]")
    session.run("pytest", "-n", "2", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the package, tests, examples and benchmarks."""
    session.install("ruff")
    session.run("ruff", "check", "jckpt", "tests", "examples", "bench", "noxfile.py")
