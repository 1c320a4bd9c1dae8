"""``python -m fastgen.serve MODEL_DIR``: the same as ``fastgen-serve``."""

from fastgen.serve.cli import cli_main

if __name__ == "__main__":
    cli_main()
