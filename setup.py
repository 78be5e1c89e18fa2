"""Build the optional C accelerator for header decoding (pure Python works without it).

`JCKPT_PURE_PYTHON=1` leaves the extension out, for a wheel that runs on any platform
(`py3-none-any`); without it the extension is built when a compiler is available and
skipped (`optional=True`) when not.
"""

import os

from setuptools import Extension, setup

PURE = os.environ.get("JCKPT_PURE_PYTHON", "") not in ("", "0")

setup(ext_modules=[] if PURE else [
    Extension("jckpt.format._canonical", ["jckpt/format/_canonical.c"], optional=True)])
