"""Shared pytest setup: import the in-tree `rankwatch` package and never touch the network."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Tests must never download anything; transformers and huggingface_hub honour this.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SDK_ROOT = Path(__file__).resolve().parent.parent
if str(SDK_ROOT) not in sys.path:
    sys.path.insert(0, str(SDK_ROOT))
