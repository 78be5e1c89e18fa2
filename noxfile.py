"""Developer workflows: `nox -s tests`, `oldest`, `lint`, `typecheck`, `docs`, `notebooks`, `build`,
`bench`."""

import shutil
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests"]


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite, two workers (the size of the CI machine)."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-n", "2", *session.posargs)


#: The layers of the library; the system tests need the newest peers (flax, orbax).
LAYERS = ["tests/format", "tests/storage", "tests/trees", "tests/api", "tests/services",
          "tests/adapters", "tests/tools"]


@nox.session
def oldest(session: nox.Session) -> None:
    """The layers' tests on the oldest dependencies pyproject.toml allows: a floor it
    declares is a floor that is tested (tests/oldest-deps.txt pins them)."""
    session.install("-c", "tests/oldest-deps.txt", "-e", ".[cloud]", "pytest>=8", "pytest-xdist>=3.5",
                    "pytest-timeout>=2.3", "hypothesis>=6.100", "optax>=0.2", "safetensors>=0.4",
                    "moto[server]>=5.1")
    session.run("python", "-c", "import jax, numpy; print('jax', jax.__version__, numpy.__version__)")
    session.run("python", "-m", "pytest", "-n", "2", *LAYERS, *session.posargs)


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


@nox.session
@nox.parametrize("extension", [True, False], ids=["c-extension", "pure-python"])
def build(session: nox.Session, extension: bool) -> None:
    """Build the sdist and, from it, a wheel; install the wheel here and smoke-test it.

    Each run is a fresh virtual environment. `build(c-extension)` builds the
    optional C accelerator into a platform wheel; `build(pure-python)` leaves
    it out (`JCKPT_PURE_PYTHON=1`, a `py3-none-any` wheel). jckpt's own wheel
    is installed with `--no-index` from the folder it was built into (never
    from an index); its dependencies come from pip's cache or index. The smoke
    test (`tests/system/smoke_installed.py`) runs from outside the source tree.
    """
    session.install("build>=1.2", "setuptools>=77")
    dist = Path(session.create_tmp()).resolve() / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    env = {"JCKPT_PURE_PYTHON": "0" if extension else "1"}
    # the sdist first, then the wheel built from the unpacked sdist: a file the sdist lacks fails here
    session.run("python", "-m", "build", "--no-isolation", "--outdir", str(dist), env=env)
    (sdist,) = dist.glob("jckpt-*.tar.gz")
    (wheel,) = dist.glob("jckpt-*.whl")
    pure = wheel.name.endswith("-py3-none-any.whl")
    if pure == extension:
        session.error(f"{wheel.name}: expected a {'platform' if extension else 'pure-Python'} wheel")
    session.log(f"built {sdist.name} and {wheel.name}")
    session.install(*_requirements(), silent=True)  # jckpt's dependencies (cached after a first run)
    session.install("--no-index", "--no-deps", "--find-links", str(dist), "jckpt")
    smoke = Path("tests/system/smoke_installed.py").resolve()
    session.chdir(session.create_tmp())  # outside the source tree: import the installed package
    session.run("python", str(smoke), "--extension" if extension else "--pure")
    session.run("jckpt", "--help", silent=True)


def _requirements() -> list[str]:
    """The core dependencies of pyproject.toml."""
    import tomllib

    with open(Path(__file__).parent / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]
