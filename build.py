#!/usr/bin/env python3
"""Run ``mxc build`` from a source checkout, without installing: ``python build.py llama.yaml --out build/tiny``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mxc.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["build", *sys.argv[1:]]))
