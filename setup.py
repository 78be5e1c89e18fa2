"""Build the optional C accelerator for header decoding (pure Python works without it)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("jckpt.format._canonical", ["jckpt/format/_canonical.c"],
                             optional=True)])
