"""`python -m jckpt`: the `jckpt` command line."""

from jckpt.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
