"""routetool traces, opened and written: the names every caller of the trace format imports.

A trace is one safetensors file (trace format v1, read by :mod:`routetool.io.tracefile`) or a
sharded trace, an index and its shards (:mod:`routetool.io.sharded`). This module holds the one
writer of a trace file (:func:`write_trace`) and gives, under one name, the reader's types and
the entry point that opens any trace (:func:`open_trace`, from :mod:`routetool.io.inputs`,
where a path is classified).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from routetool.errors import RouteToolError
from routetool.io.inputs import open_trace as open_trace
from routetool.io.paths import atomic_write, check_output_folder, path_kind
from routetool.io.tracefile import (  # noqa: F401 - the trace format's names, imported from here by callers
    _LAYER_FIELDS, FORMAT_NAME, FORMAT_VERSION, WEIGHTS_SEMANTICS, LayerArrays, LayerInfo, RouterConfig, Step, Trace,
    TraceMeta, metadata_dict, parse_metadata, read_header, router_config_errors,
)


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor that owns its storage (safetensors refuses shared storage)."""
    t = t.detach().to("cpu")
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone()
    return t


def write_trace(
    path: str | os.PathLike,
    meta: TraceMeta,
    layers: Mapping[int, LayerArrays],
    *,
    force: bool = False,
) -> Path:
    """Write a trace v1 file atomically (temporary file in the same folder, then rename).

    Args:
        path: destination ``.safetensors`` file.
        meta: trace metadata.
        layers: layer index -> tensors; ``gating_output`` ``[T, E]`` or ``topk_ids``
            ``[T, K]`` is required per layer, everything else optional.
        force: replace an existing file; without it an existing file is an error.

    Returns:
        The path written.

    Raises:
        RouteToolError: the file exists (and not ``force``), the folder is missing or not
            writable, the disk is full, or the data does not satisfy the schema (checked by
            reading the written file back before it replaces anything).
    """
    path = Path(path)
    kind = path_kind(path)
    if kind in ("file", "folder", "special") and not force:
        raise RouteToolError("already exists", path=path, fix="choose another path or pass --force to replace it")
    if kind == "folder":
        raise RouteToolError("is a directory", path=path, fix="name a file")
    check_output_folder(path.parent)
    problems = meta.router.problems()
    if problems:
        raise RouteToolError("; ".join(problems), path=path, tensor="__metadata__", fix="fix the router parameters")
    tensors: dict[str, torch.Tensor] = {}
    stored: set[int] = set()
    for layer, arrays in sorted(layers.items()):
        for name in _LAYER_FIELDS:
            value = getattr(arrays, name)
            if value is not None:
                t = _standalone(value)
                if t.untyped_storage().data_ptr() in stored:  # one tensor given for two layers: one copy each
                    t = t.clone()
                stored.add(t.untyped_storage().data_ptr())
                tensors[f"layers.{int(layer)}.{name}"] = t
    def write_and_check(tmp: str) -> None:
        try:
            save_file(tensors, tmp, metadata=metadata_dict(meta, len(layers)))
        except SafetensorError as exc:
            raise RouteToolError(f"cannot write ({exc})", path=path, fix="check free disk space and permissions") from None
        Trace(tmp, display_path=path).close()  # validate what was written before it replaces anything

    atomic_write(path, write_and_check)
    return path
