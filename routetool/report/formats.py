"""Documents written beside the terminal report: JSON (non-finite numbers as null), plain text
(JUnit XML), each written atomically or to stdout."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

from routetool.io.paths import atomic_write

if TYPE_CHECKING:  # the types of the results rendered here; importing them would import torch
    from routetool.engine.load import LoadStats


def load_json(load: LoadStats | None, unit: str = "tokens") -> dict | None:
    """Load statistics as JSON; ``unit`` names what the counts count (``tokens``, ``assignments``)."""
    if load is None:
        return None
    return {
        "num_experts": load.num_experts,
        "assignments": load.assignments,
        f"max_load_{unit}": load.max_load,
        f"mean_load_{unit}": load.mean_load,
        "imbalance_max_over_mean": load.imbalance,
        "cv": load.cv,
        "normalized_entropy": load.normalized_entropy,
        "gini": load.gini,
        "hottest": [{"expert": e, unit: c} for e, c in load.hottest],
        "idle_experts": load.idle,
    }


def idle_layer_expert_pairs(loads) -> int:
    """Idle experts counted in each layer and summed over the layers: the layer-expert pairs no
    token chose (an expert idle in two layers counts twice). Printed as ``idle layer-expert pairs
    N`` and written as ``idle_layer_expert_pairs``, beside the experts idle over all layers
    together (``idle_experts`` of the all-layers load, often none)."""
    return sum(len(x.idle) for x in loads if x is not None)


def _clean(value):
    """Replace non-finite floats by None (JSON has no NaN/inf)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(document: dict, path: str, console_out) -> None:
    """Write ``document`` as JSON to ``path`` atomically, or to ``console_out`` when path is ``-``.

    Raises:
        RouteToolError: the folder is not writable or the disk is full.
    """
    write_text(json.dumps(_clean(document), indent=2, allow_nan=False) + "\n", path, console_out)


_XML_ILLEGAL = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
"""Characters XML 1.0 cannot hold, not even as character references (its ``Char`` production)."""


def xml_safe(text: str) -> str:
    """``text`` with every character XML 1.0 cannot hold (control characters other than tab,
    newline and carriage return; lone surrogates; U+FFFE, U+FFFF) written as its Python escape
    (``\\x00``, ``\\x1b``, ``\\udc80``), so that any parser reads the document."""
    return _XML_ILLEGAL.sub(lambda m: repr(m.group())[1:-1], text)


def write_text(text: str, path: str, console_out) -> None:
    """Write ``text`` to ``path`` atomically, or to ``console_out`` when path is ``-``.

    Raises:
        RouteToolError: the folder is not writable or the disk is full.
    """
    if path == "-":
        console_out.write(text)
        console_out.flush()
        return
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


