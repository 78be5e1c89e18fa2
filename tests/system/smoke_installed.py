"""A smoke test of jckpt as installed from a wheel: `nox -s build` runs it in a fresh environment.

    python tests/system/smoke_installed.py --extension   # the C accelerator must be there
    python tests/system/smoke_installed.py --pure        # and here it must not be

Run from outside the repository, so that `import jckpt` finds the installed package:
it saves and restores a tree (a typed PRNG key included), verifies the file, checks that
the type hints ship (`py.typed`), and runs `jckpt --help` and `jckpt verify` through the
installed console script.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--extension", action="store_true", help="the wheel has the C accelerator")
    which.add_argument("--pure", action="store_true", help="the wheel is pure Python")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jckpt
    from jckpt.format import fastpath

    package = Path(jckpt.__file__).resolve().parent
    repo = Path(__file__).resolve().parents[2]
    assert package != repo / "jckpt", f"jckpt imported from the source tree ({package})"
    assert (package / "py.typed").is_file(), "py.typed is not installed"
    assert (fastpath.accelerator is not None) == args.extension, \
        f"C accelerator {'missing' if args.extension else 'present'} in {package}"

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "smoke.jckpt")
        tree = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.int32(7), "rng": jax.random.key(0)}
        jckpt.save(jckpt.Context(), tree, path)
        back = jckpt.restore(jckpt.Context(), jax.eval_shape(lambda: tree), path)
        np.testing.assert_array_equal(back["w"], tree["w"])
        assert int(back["step"]) == 7
        np.testing.assert_array_equal(jax.random.key_data(back["rng"]), jax.random.key_data(tree["rng"]))
        script = shutil.which("jckpt")
        assert script is not None, "the jckpt console script is not installed"
        help_text = subprocess.run([script, "--help"], check=True, capture_output=True, text=True).stdout
        assert "verify" in help_text, help_text
        subprocess.run([script, "verify", path], check=True, capture_output=True, text=True)
    print(f"ok: jckpt {jckpt.__version__} from {package} "
          f"({'with' if args.extension else 'without'} the C accelerator)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
