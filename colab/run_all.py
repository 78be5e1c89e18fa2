"""Run every notebook in this folder top to bottom on CPU; exit non-zero on the first error.

    python colab/run_all.py                     # all notebooks
    python colab/run_all.py quickstart.ipynb    # some of them

Each notebook runs in a fresh kernel, in its own temporary directory, with the
repository's ``jckpt`` importable (so the notebooks' install cells skip). The
notebooks in the repository stay without outputs; ``--output DIR`` writes the executed
copies there instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run_notebook(path: Path, timeout: int, output: Path | None = None) -> float:
    """Execute ``path`` in a fresh kernel; return the seconds it took. Raises on any error.

    With ``output``, the executed notebook (with its outputs) is written there.
    """
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    env_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.environ["PYTHONPATH"] = env_path
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with tempfile.TemporaryDirectory(prefix=f"{path.stem}-") as cwd:
        client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                         resources={"metadata": {"path": cwd}})
        start = time.perf_counter()
        before = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = cwd  # the kernel's tempfile.mkdtemp() folders go with cwd
        try:
            client.execute()
        finally:
            if before is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = before
            if output is not None:
                output.mkdir(parents=True, exist_ok=True)
                nbformat.write(nb, output / path.name)
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="notebook names (default: all in colab/)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    parser.add_argument("--output", type=Path, help="write the executed notebooks to this folder")
    args = parser.parse_args(argv)
    paths = [HERE / n for n in args.notebooks] or sorted(HERE.glob("*.ipynb"))
    if not paths:
        print("no notebooks found", file=sys.stderr)
        return 1
    total = 0.0
    for path in paths:
        print(f"running {path.name} ...", flush=True)
        try:
            seconds = run_notebook(path, args.timeout, args.output)
        except Exception as err:  # nbclient's CellExecutionError carries the traceback
            print(f"FAILED {path.name}:\n{err}", file=sys.stderr)
            return 1
        total += seconds
        print(f"ok {path.name} in {seconds:.1f} s", flush=True)
    print(f"{len(paths)} notebooks ran in {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
