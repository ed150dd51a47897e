"""`python -m rankwatch ...`: the same command as the `rankwatch` console script (`cli.py`)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
