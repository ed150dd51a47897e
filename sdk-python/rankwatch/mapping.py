"""A user's description of a model's layout (`mapping=`), as `rankwatch run --mapping` and
`rankwatch attach --mapping` take it on the command line: JSON text or the path of a JSON file.

Torch-free, so that the launcher and the attach command can check a mapping before any training
process sees it; `discovery/user_mapping.py` resolves it against the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MATRIX_SITES: tuple[str, ...] = ("q", "k", "v", "o", "up", "gate", "down")
MAPPING_KEYS = frozenset(MATRIX_SITES) | {
    "blocks", "transposed", "attention", "embed", "final_norm", "attn", "mlp", "gate_act",
}


def check(mapping: object) -> dict[str, Any]:
    """`mapping` as a dict, or ValueError naming what is wrong with its shape."""
    if not isinstance(mapping, dict):
        raise ValueError(f"a mapping is a JSON object, got {type(mapping).__name__}")
    unknown = set(mapping) - MAPPING_KEYS
    if unknown:
        raise ValueError(f"mapping has unknown keys {sorted(unknown)}; allowed: {sorted(MAPPING_KEYS)}")
    if not isinstance(mapping.get("blocks"), str) or not mapping["blocks"]:
        raise ValueError("mapping needs 'blocks': the dotted path of the ModuleList of blocks")
    for key in MAPPING_KEYS - {"transposed", "attention"}:
        if key in mapping and not isinstance(mapping[key], str):
            raise ValueError(f"mapping '{key}' must be a dotted path (a string), got {mapping[key]!r}")
    transposed = mapping.get("transposed", [])
    if not isinstance(transposed, (list, tuple)) or not set(transposed) <= set(MATRIX_SITES):
        raise ValueError(f"mapping 'transposed' must list sites among {list(MATRIX_SITES)}, got {transposed!r}")
    attention = mapping.get("attention")
    if attention is not None and (not isinstance(attention, dict) or not {"n_heads", "head_dim"} <= set(attention)):
        raise ValueError("mapping 'attention' must be {'n_heads': N, 'n_kv_heads': N, 'head_dim': N}")
    return mapping


def parse(text: str) -> dict[str, Any]:
    """`--mapping`'s value: JSON text (starting with `{` or `[`), else the path of a JSON file."""
    text = text.strip()
    if not text.startswith(("{", "[")):
        path = Path(text)
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"--mapping is neither JSON nor a readable file: {e}") from e
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--mapping is not valid JSON: {e}") from e
    return check(value)


def stored(collector: str, run: str, token: str | None = None, timeout: float = 5.0) -> dict[str, Any] | None:
    """The mapping an earlier watch of `run` kept at the collector (its `mapping` tag), so
    that attaching again, or relaunching under the same name, needs no `--mapping`. None when
    the collector has no such run or tag, or cannot be reached (the caller goes on without)."""
    import urllib.request

    request = urllib.request.Request(
        collector.rstrip("/") + "/api/v1/runs", headers={"Authorization": f"Bearer {token}"} if token else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            runs = json.loads(answer.read()).get("runs", [])
    except (OSError, ValueError):
        return None
    for summary in runs:
        if summary.get("run") == run:
            text = (summary.get("tags") or {}).get("mapping")
            if text:
                try:
                    return check(json.loads(text))
                except ValueError:
                    return None
    return None
