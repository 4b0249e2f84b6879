"""What a trace holds: metadata, provenance, layers, steps, tensor shapes/dtypes, sizes.

:func:`trace_info` reads only what opening a trace reads (the safetensors headers, the
per-layer ``bias`` and ``step_offsets``, a sharded trace's index), so it is fast on traces of
any size. With ``scan=True`` it also streams every step's rows from disk, one step at a
time, to count padded rows and rows with non-finite logits.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from routetool.io.paths import refuse_special_file
from routetool.io.tracefile import FORMAT_VERSION, RouterConfig, read_header

_ST_DTYPE_NAMES = {
    "F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}
_TENSOR_ORDER = ("gating_output", "bias", "is_padding", "step_offsets", "topk_ids", "topk_weights")


@dataclass(frozen=True)
class TensorSummary:
    """Shape and dtype of one per-layer tensor (shapes summed over the shards of a sharded trace)."""

    shape: tuple[int, ...]
    dtype: str


@dataclass
class LayerSummary:
    """One MoE layer of a trace.

    Attributes:
        layer: layer index. num_tokens: rows (T). num_steps: captured steps.
        step_tokens: rows of each step, in order.
        tensors: tensor field (``gating_output``, ``bias``, ...) -> shape and dtype, for the
            tensors the trace stores.
        has_bias / has_padding / has_recorded_ids / has_recorded_weights: optional tensors present.
        bias_abs_max: largest |bias| (0 without a bias).
        padded_rows / nonfinite_rows / nonfinite_padded_rows: counted by a scan, else None.
    """

    layer: int
    num_tokens: int
    num_steps: int
    step_tokens: list[int]
    tensors: dict[str, TensorSummary]
    has_bias: bool
    has_padding: bool
    has_recorded_ids: bool
    has_recorded_weights: bool
    bias_abs_max: float
    padded_rows: int | None = None
    nonfinite_rows: int | None = None
    nonfinite_padded_rows: int | None = None

    @property
    def padded_fraction(self) -> float | None:
        if self.padded_rows is None:
            return None
        return self.padded_rows / self.num_tokens if self.num_tokens else 0.0


@dataclass(frozen=True)
class TraceFile:
    """One file of a trace on disk."""

    path: str
    size_bytes: int
    role: str  # "trace", "index" or "shard"


@dataclass
class TraceInfo:
    """Everything ``routetool info`` reports (rendered by :mod:`routetool.report.capture`).

    Attributes:
        trace: the path given. sharded: an index + shards. files: the files, with sizes.
        format_version: trace format version. model / provenance: from the metadata.
        router: router parameters. metadata: the other metadata keys (``capture``,
            ``generator``, ``weights_semantics``, ...).
        index: for a sharded trace: ``complete``, ``stopped_by``, ``num_shards`` and
            ``last_complete_step`` (the recorder's number of the last step its shards hold whole;
            None when the index does not say) (else None).
        layers: per-layer summaries. scanned: whether the data were read (``--scan``).
        step_shapes: rows per step -> steps (of one layer when steps_same_in_all_layers,
            else layer-steps over all layers).
    """

    trace: str
    sharded: bool
    files: list[TraceFile]
    format_version: str
    model: str
    provenance: str
    router: RouterConfig
    metadata: dict[str, str]
    index: dict | None
    layers: list[LayerSummary]
    scanned: bool
    step_shapes: dict[int, int] = field(default_factory=dict)
    steps_same_in_all_layers: bool = True

    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    @property
    def total_tokens(self) -> int:
        return sum(layer.num_tokens for layer in self.layers)

    @property
    def total_steps(self) -> int:
        return sum(layer.num_steps for layer in self.layers)

    @property
    def recorded_outputs(self) -> str:
        """``all``, ``some`` or ``none`` of the layers carry recorded ``topk_ids``."""
        n = sum(layer.has_recorded_ids for layer in self.layers)
        return "all" if n == len(self.layers) else ("none" if n == 0 else "some")

    @property
    def padded_rows(self) -> int | None:
        return None if not self.scanned else sum(layer.padded_rows or 0 for layer in self.layers)

    @property
    def nonfinite_rows(self) -> int | None:
        return None if not self.scanned else sum(layer.nonfinite_rows or 0 for layer in self.layers)

    @property
    def padded_fraction(self) -> float | None:
        if not self.scanned:
            return None
        return self.padded_rows / self.total_tokens if self.total_tokens else 0.0


def check_trace_file(path: str | Path) -> None:
    """Refuse a trace path that exists but is not a regular file or a folder (a FIFO, a
    device, a socket), before anything opens it: reading one could block forever.

    A missing path or a directory is left to :func:`routetool.io.inputs.open_trace`, which names
    them (a sharded trace's shards are checked by :class:`routetool.io.sharded.ShardedTrace`).

    Raises:
        RouteToolError: naming the path and the fix.
    """
    refuse_special_file(path, fix="name a .safetensors trace or a sharded trace's index .json")


def _header_dtypes(paths: list[Path]) -> dict[str, str]:
    """Tensor name -> dtype name, from the safetensors headers of ``paths`` (first file wins),
    read as opening the trace read them (:func:`routetool.io.trace.read_header`)."""
    out: dict[str, str] = {}
    for path in paths:
        for name, entry in (read_header(path) or {}).items():
            if name != "__metadata__" and isinstance(entry, dict) and name not in out:
                st = str(entry.get("dtype"))
                out[name] = _ST_DTYPE_NAMES.get(st, st)
    return out


def step_shape_counts(layers: list[LayerSummary]) -> tuple[dict[int, int], bool]:
    """Rows per step -> number of steps with that many rows (sorted by rows).

    Returns:
        ``(counts, per_layer)``: when every layer has the same steps (the usual case), the
        counts of one layer and ``per_layer`` True; otherwise counts of layer-steps over all
        layers and False.
    """
    if layers and all(layer.step_tokens == layers[0].step_tokens for layer in layers):
        return dict(sorted(Counter(layers[0].step_tokens).items())), True
    counts = Counter(n for layer in layers for n in layer.step_tokens)
    return dict(sorted(counts.items())), False


def step_token_quantiles(step_tokens: list[int]) -> tuple[int, float, int] | None:
    """(min, median, max) rows per step, or None without steps."""
    if not step_tokens:
        return None
    return min(step_tokens), float(statistics.median(step_tokens)), max(step_tokens)


def trace_info(trace, *, scan: bool = False, progress: Callable[[int], None] | None = None) -> TraceInfo:
    """Summarise an open trace (:func:`routetool.io.inputs.open_trace`).

    Args:
        trace: a :class:`~routetool.io.trace.Trace` or :class:`~routetool.io.sharded.ShardedTrace`.
        scan: also read every step (one at a time) to count padded and non-finite rows.
        progress: called with the rows done after each scanned step.

    Returns:
        A :class:`TraceInfo`.

    Raises:
        RouteToolError: a file that cannot be read during the scan.
    """
    meta = trace.meta
    r = meta.router
    shard_paths = list(getattr(trace, "shard_paths", []) or [])
    sharded = bool(shard_paths)
    data_files = shard_paths if sharded else [Path(trace.path)]
    dtypes = _header_dtypes(data_files)
    files = []
    if sharded:
        files.append(TraceFile(str(trace.display_path), Path(trace.path).stat().st_size, "index"))
        for shown, p in zip((s.display_path for s in trace.shards), shard_paths):
            files.append(TraceFile(str(shown), p.stat().st_size, "shard"))
    else:
        files.append(TraceFile(str(trace.display_path), Path(trace.path).stat().st_size, "trace"))

    layers: list[LayerSummary] = []
    for layer in trace.layers:
        info = trace.info(layer)
        T, S = info.num_tokens, info.num_steps
        E, K = r.num_experts, r.topk
        shapes = {
            "gating_output": (T, E) if info.has_logits else None,
            "bias": (E,) if info.has_bias else None,
            "is_padding": (T,) if info.has_padding else None,
            "step_offsets": (S + 1,),
            "topk_ids": (T, K) if info.has_recorded_ids else None,
            "topk_weights": (T, K) if info.has_recorded_weights else None,
        }
        tensors = {}
        for name in _TENSOR_ORDER:
            shape = shapes[name]
            key = f"layers.{layer}.{name}"
            if shape is None or (name == "step_offsets" and key not in dtypes):
                continue
            tensors[name] = TensorSummary(shape=shape, dtype=dtypes.get(key, "bool" if name == "is_padding" else "?"))
        offsets = info.step_offsets
        layers.append(LayerSummary(
            layer=layer, num_tokens=T, num_steps=S,
            step_tokens=[b - a for a, b in zip(offsets, offsets[1:])],
            tensors=tensors, has_bias=info.has_bias, has_padding=info.has_padding,
            has_recorded_ids=info.has_recorded_ids, has_recorded_weights=info.has_recorded_weights,
            bias_abs_max=float(trace.bias(layer).abs().max()) if r.num_experts else 0.0,
        ))

    if scan:
        for summary in layers:
            padded = nonfinite = nonfinite_padded = 0
            # (per row, so read in bounded row ranges whatever the steps: one step may be gigabytes)
            from routetool.io.limits import row_ranges

            row_bytes = 4 * max(r.num_experts, 1) + 16 * max(r.topk, 1)
            for a, b in row_ranges(summary.num_tokens, row_bytes):
                step = trace.read_rows(summary.layer, a, b)
                pad = step.is_padding
                if pad is not None:
                    padded += int(pad.sum())
                if step.gating_output is not None:
                    bad = (~torch.isfinite(step.gating_output)).any(-1)
                    nonfinite += int(bad.sum())
                    if pad is not None:
                        nonfinite_padded += int((bad & pad).sum())
                if progress is not None:
                    progress(b - a)
            summary.padded_rows, summary.nonfinite_rows = padded, nonfinite
            summary.nonfinite_padded_rows = nonfinite_padded

    index = None
    if sharded:
        doc = trace.index
        index = {"complete": doc.get("complete"), "stopped_by": doc.get("stopped_by"),
                 "num_shards": len(doc.get("shards", [])), "last_complete_step": _last_step(doc)}
    shapes, same = step_shape_counts(layers)
    return TraceInfo(
        trace=str(trace.display_path), sharded=sharded, files=files, format_version=FORMAT_VERSION,
        model=meta.model, provenance=meta.provenance, router=r, metadata=dict(meta.extra), index=index,
        layers=layers, scanned=scan, step_shapes=shapes, steps_same_in_all_layers=same,
    )


def _last_step(doc: dict) -> int | None:
    """The last complete step a sharded trace's index names (``last_complete_step``, else its
    last shard's ``last_step``), or None."""
    for value in (doc.get("last_complete_step"), (doc.get("shards") or [{}])[-1].get("last_step")):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None
