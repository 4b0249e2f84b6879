"""routetool trace format v1: one safetensors file of router inputs (and optional outputs), read.

The schema is documented in docs/trace-format.md. This module holds the one reader of it
(:class:`Trace`), the metadata both the reader and the writer use, and the header reader;
the writer (:func:`routetool.io.trace.write_trace`) and the entry point that opens any trace
(:func:`routetool.io.inputs.open_trace`) sit above it, as does the sharded trace
(:mod:`routetool.io.sharded`) whose shards are files of this format. The reader is lazy:
opening a trace reads the header, checks every tensor's name, shape and dtype and the small
per-layer tensors (bias, step_offsets), and reads the large ones (gating_output, is_padding,
recorded outputs) one step at a time, so a trace larger than memory can be replayed. Every
problem becomes a :class:`~routetool.errors.RouteToolError` naming the file and the tensor. The
router's metadata keys are read and written by :class:`routetool_kernels.spec.RouterSpec`
(``RouterConfig`` here).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from routetool_kernels.spec import PLAIN_INT_FIX, RouterSpec, SpecError
from routetool.errors import RouteToolError
from routetool.io.paths import require_input
from routetool.io.jsonstrict import JSONProblem, loads
from routetool.io.limits import check_expert_tables
from routetool.numtext import index_problem, parse_int

FORMAT_NAME = "routetool-trace"
FORMAT_VERSION = "1"
WEIGHTS_SEMANTICS = ("renormalized", "unnormalized")

_LAYER_TENSOR = re.compile(r"layers\.([^.]+)\.([a-z_]+)")  # the index is checked by numtext.is_index
_LAYER_FIELDS = ("gating_output", "bias", "is_padding", "step_offsets", "topk_ids", "topk_weights")
_ST_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)
_OFFSET_DTYPES = (torch.int64, torch.int32)
_LAYOUT_FIX = "store it with that dtype and shape (docs/trace-format.md, the table of tensors)"
_FIELD_DTYPES = {  # what each tensor may be stored as (docs/trace-format.md, the table of tensors)
    "gating_output": _FLOAT_DTYPES, "bias": _FLOAT_DTYPES, "is_padding": (torch.bool,),
    "step_offsets": _OFFSET_DTYPES, "topk_ids": _ID_DTYPES, "topk_weights": _FLOAT_DTYPES,
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtypes_text(field_name: str) -> str:
    """The dtypes a layer tensor accepts, in words: ``float32, bfloat16 or float16``."""
    names = [_dtype_name(d) for d in _FIELD_DTYPES[field_name]]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


RouterConfig = RouterSpec
"""The router's parameters, shared by every layer of a trace: :class:`routetool_kernels.spec.RouterSpec`."""


@dataclass(frozen=True)
class TraceMeta:
    """Trace-level metadata (the safetensors ``__metadata__``).

    Attributes:
        model: the model the trace was captured from (free text, e.g. a HF model id).
        router: the router parameters.
        provenance: how and from what the trace was made (free text, one line or more).
        extra: any further string metadata, kept as is (e.g. ``weights_semantics``).
    """

    model: str
    router: RouterSpec
    provenance: str
    extra: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerInfo:
    """What a trace holds for one MoE layer (from the header; no tensor data read).

    Attributes:
        layer: the layer index ``L`` in the tensor names.
        num_tokens: rows (T) of the layer.
        step_offsets: token offsets of the captured forward steps, ``[0, ..., T]``.
        gating_dtype: dtype of ``gating_output``, or None for an ids-only layer.
        has_bias, has_padding, has_recorded_ids, has_recorded_weights: which optional
            tensors are present.
    """

    layer: int
    num_tokens: int
    step_offsets: tuple[int, ...]
    gating_dtype: torch.dtype | None
    has_bias: bool
    has_padding: bool
    has_recorded_ids: bool
    has_recorded_weights: bool

    @property
    def num_steps(self) -> int:
        return len(self.step_offsets) - 1

    @property
    def has_logits(self) -> bool:
        return self.gating_dtype is not None


@dataclass
class Step:
    """The inputs (and recorded outputs) of one captured forward step of one layer.

    Attributes:
        layer: layer index. index: step number within the layer. start: first token row.
        gating_output: ``[n, E]`` logits as stored (float32/bfloat16/float16), or None for
            an ids-only trace.
        bias: ``[E]`` float32.
        is_padding: ``[n]`` bool, or None when the trace has no padding mask.
        recorded_ids: ``[n, K]`` int production ``topk_ids``, or None.
        recorded_weights: ``[n, K]`` production ``topk_weights``, or None.
    """

    layer: int
    index: int
    start: int
    gating_output: torch.Tensor | None
    bias: torch.Tensor
    is_padding: torch.Tensor | None
    recorded_ids: torch.Tensor | None
    recorded_weights: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        for t in (self.gating_output, self.recorded_ids):
            if t is not None:
                return int(t.shape[0])
        return 0


@dataclass
class LayerArrays:
    """Tensors of one layer, as handed to :func:`routetool.io.trace.write_trace` (shapes as in the schema)."""

    gating_output: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    is_padding: torch.Tensor | None = None
    step_offsets: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None


_REQUIRED_KEYS = {
    # key: (what to add, its meaning), for the message naming a missing key (docs/trace-format.md)
    "format": (f'format="{FORMAT_NAME}"', "the file is a routetool trace"),
    "format_version": (f'format_version="{FORMAT_VERSION}"', "the trace format version it follows"),
}


def _missing_key(path: Path, key: str, prefix: str = "") -> RouteToolError:
    """The one-line error for a required metadata key that is absent: the key to add and its meaning."""
    add, meaning = _REQUIRED_KEYS[key]
    return RouteToolError(f"{prefix}metadata key {key!r} is missing", path=path, tensor="__metadata__",
                          fix=f"add {add} to the metadata: {meaning}; see docs/trace-format.md")


def router_config_errors(router: RouterSpec) -> list[str]:
    """Why a router configuration is impossible (empty list when it is fine): :meth:`RouterSpec.problems`."""
    return router.problems()


def parse_metadata(path: Path, raw: Mapping[str, str] | None) -> TraceMeta:
    """Parse and check a trace's ``__metadata__``.

    Raises:
        RouteToolError: missing or malformed keys (a number that is not a plain decimal,
            such as ``2_5`` or non-ASCII digits, included), another format or version, or an
            impossible router configuration (topk > num_experts, route_scale <= 0 ...).
    """
    raw = dict(raw or {})
    if "format" not in raw:
        raise _missing_key(path, "format", prefix="not a routetool trace: ")
    if raw["format"] != FORMAT_NAME:
        raise RouteToolError(
            f"not a routetool trace (metadata format={raw['format']!r}, expected {FORMAT_NAME!r})",
            path=path, tensor="__metadata__",
            fix=f'write format="{FORMAT_NAME}" in a trace that follows docs/trace-format.md, or make traces with '
                "`routetool synth`, the capture API or `routetool import`",
        )
    if "format_version" not in raw:
        raise _missing_key(path, "format_version")
    if raw["format_version"] != FORMAT_VERSION:
        raise RouteToolError(
            f"trace format version {raw['format_version']!r} is not supported (this routetool reads {FORMAT_VERSION!r})",
            path=path, tensor="__metadata__",
            fix=f'a trace that follows docs/trace-format.md says format_version="{FORMAT_VERSION}"; '
                "for a trace of a newer format, upgrade routetool",
        )
    try:
        router = RouterSpec.from_metadata(raw)
    except SpecError as exc:
        raise RouteToolError(exc.problem, path=path, tensor="__metadata__", fix=exc.fix) from None
    if router.unsupported():
        raise RouteToolError(router.unsupported(), path=path, tensor="__metadata__",
                             fix="this routetool does not route that router yet: leave the key out, or upgrade routetool")
    semantics = raw.get("weights_semantics")
    if semantics is not None and semantics not in WEIGHTS_SEMANTICS:
        raise RouteToolError(f"metadata weights_semantics={semantics!r} is not one of {', '.join(WEIGHTS_SEMANTICS)}",
                             path=path, tensor="__metadata__",
                             fix="write renormalized (route_scale * s_i / (sum of picked s + eps), the default) or "
                                 "unnormalized (route_scale * s_i) for the recorded topk_weights; see docs/trace-format.md")
    known = {"format", "format_version", "model", "num_layers", "provenance"} | RouterSpec.metadata_keys()
    return TraceMeta(
        model=raw.get("model", ""),
        router=router,
        provenance=raw.get("provenance", ""),
        extra={k: v for k, v in raw.items() if k not in known},
    )


def metadata_dict(meta: TraceMeta, num_layers: int) -> dict[str, str]:
    """The ``__metadata__`` strings for ``meta`` (inverse of :func:`parse_metadata`)."""
    out = dict(meta.extra)
    out.update({
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "model": meta.model,
        "num_layers": str(num_layers),
        **meta.router.to_metadata(),
        "provenance": meta.provenance,
    })
    return out


class Trace:
    """A lazily read, validated routetool trace file.

    Use as a context manager (``with Trace(path) as trace:``) or call :meth:`close`.

    Attributes:
        path: the file. meta: parsed metadata. layers: layer indices, ascending.

    Raises:
        RouteToolError: on open, for a missing or unreadable file, a path that is not valid
            UTF-8 (safetensors opens no other), a file that is not
            safetensors or is truncated, wrong metadata (numbers not written as plain
            decimals included), unknown/missing tensors, a layer index not written in
            canonical ASCII digits (``layers.00``, two names for one layer), wrong shapes or
            dtypes, inconsistent sizes, a non-finite bias or bad step_offsets.
    """

    def __init__(self, path: str | os.PathLike, *, display_path: str | os.PathLike | None = None):
        self.path = Path(path)
        self.display_path = Path(display_path) if display_path is not None else self.path
        kind = require_input(self.path, shown=self.display_path)
        if kind == "folder":
            raise RouteToolError("is a directory, not a trace file", path=self.display_path, fix="name a .safetensors trace")
        if kind != "file":
            raise RouteToolError("is not a regular file", path=self.display_path, fix="name a .safetensors trace file")
        try:
            os.fsencode(self.path).decode("utf-8")
        except UnicodeDecodeError:  # safetensors takes UTF-8 paths only, and would call the file corrupt
            raise RouteToolError("the file's path is not valid UTF-8, which safetensors cannot open",
                                 path=self.display_path, fix="rename the file (or a folder above it) to a UTF-8 name") from None
        read_header(self.path, self.display_path)  # strictly, before safetensors reads it
        try:
            self._file = safe_open(str(self.path), framework="pt", device="cpu")
        except SafetensorError as exc:
            if not _begins_as_safetensors(self.path):  # (README.md, a log: no trace at all, not a damaged one)
                raise RouteToolError(
                    "not a readable safetensors file: it does not begin with a safetensors header, so it is no "
                    "routetool trace", path=self.display_path,
                    fix="name a routetool trace: a .safetensors file routetool wrote, or a sharded trace's index .json",
                ) from None
            raise RouteToolError(
                f"not a readable safetensors file ({exc})", path=self.display_path,
                fix="the file is corrupt or truncated; capture or copy it again",
            ) from None
        except OSError as exc:
            raise RouteToolError(f"cannot read file ({exc.strerror or exc})", path=self.display_path, fix="check permissions") from None
        self.meta = parse_metadata(self.display_path, self._file.metadata())
        self._headers = self._read_headers()
        self._check_budget()
        self._bias: dict[int, torch.Tensor] = {}
        self._infos: dict[int, LayerInfo] = {}
        for layer in sorted(self._headers):
            self._infos[layer] = self._check_layer(layer)
        self.layers = tuple(sorted(self._infos))
        declared = self._file.metadata().get("num_layers")
        if declared is not None and parse_int(declared) is None:
            raise RouteToolError(f"metadata num_layers={declared!r} is not a plain decimal integer",
                                 path=self.display_path, tensor="__metadata__", fix=PLAIN_INT_FIX)
        if declared is not None and parse_int(declared) != len(self.layers):
            raise RouteToolError(
                f"metadata num_layers={declared} but the file holds {len(self.layers)} layers",
                path=self.display_path, tensor="__metadata__",
                fix=f"write num_layers={len(self.layers)}, or leave the key out (it is optional)",
            )

    # -- context manager -------------------------------------------------------------------
    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._file = None

    # -- header checks ----------------------------------------------------------------------
    def _read_headers(self) -> dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
        layers: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
        names = set(self._file.keys())
        for name in self._file.keys():
            m = _LAYER_TENSOR.fullmatch(name)
            if not m or m.group(2) not in _LAYER_FIELDS:
                raise RouteToolError(
                    "unknown tensor name", path=self.display_path, tensor=name,
                    fix=f"trace v1 holds only layers.<L>.{{{','.join(_LAYER_FIELDS)}}}",
                )
            index = m.group(1)
            value = parse_int(index) if index.isdigit() else None  # ASCII digits only (parse_int)
            problem = index_problem(index) or ("" if value is not None else f"{index[:20]!r}... is too long")
            if problem:
                # one spelling per layer: int() would read layers.00, layers.1_0 or Arabic-Indic digits as
                # layers.0, layers.10, layers.3, and one layer's tensors would silently replace another's
                canonical = f"layers.{value}.{m.group(2)}" if value is not None else None
                if canonical in names:
                    problem += f"; the trace also holds {canonical}: two names for layer {value}"
                    fix = f"keep one of {canonical} and {name}"
                elif canonical:
                    fix = f"rename it {canonical}"
                else:
                    fix = "name tensors layers.<L>.<field> with L in ASCII digits 0-9, no leading zeros"
                raise RouteToolError(f"layer index {problem}", path=self.display_path, tensor=name,
                                     fix=fix + "; re-export the trace with routetool's writer")
            sl = self._file.get_slice(name)
            st_dtype = sl.get_dtype()
            if st_dtype not in _ST_DTYPES:
                raise RouteToolError(f"has dtype {st_dtype}; expected {_dtypes_text(m.group(2))}",
                                     path=self.display_path, tensor=name,
                                     fix="store it in one of those dtypes (docs/trace-format.md)")
            layers.setdefault(value, {})[m.group(2)] = (tuple(sl.get_shape()), _ST_DTYPES[st_dtype])
        if not layers:
            raise RouteToolError("the trace holds no layers", path=self.display_path, fix="capture at least one MoE layer")
        return layers

    def _check_budget(self) -> None:
        """Refuse, before any per-layer tensor is made, a trace whose num_experts would make the
        per-expert tables of its steps exceed what a file of its size may take
        (:func:`routetool.io.limits.check_expert_tables`): an ids-only trace declaring a million
        experts for a few rows. A trace with logits always fits (they are [T, E])."""
        steps = 0
        for h in self._headers.values():
            shape = h.get("step_offsets", ((2,), None))[0]
            steps += max(shape[0] - 1, 1) if len(shape) == 1 else 1
        check_expert_tables(self.display_path, experts=self.meta.router.num_experts, layer_steps=steps,
                            layers=len(self._headers), size=os.stat(self.path).st_size, tensor="__metadata__",
                            fix="write the model's real num_experts in the metadata")

    def _fail(self, tensor: str, message: str, fix: str = "re-capture or re-export the trace") -> RouteToolError:
        """A one-line error naming the file and ``tensor``; ``fix`` defaults to re-making the trace."""
        return RouteToolError(message, path=self.display_path, tensor=tensor, fix=fix)

    def _check_layer(self, layer: int) -> LayerInfo:
        h = self._headers[layer]
        p = f"layers.{layer}."
        r = self.meta.router
        E, K = r.num_experts, r.topk
        T = None
        gating_dtype = None
        if "gating_output" in h:
            shape, dtype = h["gating_output"]
            if len(shape) != 2:
                raise self._fail(p + "gating_output", f"has shape {list(shape)}; expected [num_tokens, num_experts={E}]",
                                 fix=_LAYOUT_FIX)
            if dtype not in _FIELD_DTYPES["gating_output"]:
                raise self._fail(p + "gating_output", f"has dtype {_dtype_name(dtype)}; expected {_dtypes_text('gating_output')}",
                                 fix=_LAYOUT_FIX)
            if shape[1] != E:
                raise self._fail(p + "gating_output", f"has {shape[1]} experts but metadata num_experts={E}",
                                 fix="every layer must have num_experts columns; fix the metadata or the tensor")
            T = shape[0]
            gating_dtype = dtype
        elif "topk_ids" not in h:
            raise self._fail(p + "gating_output", "missing (the layer has neither gating_output nor topk_ids)",
                             fix=f"add {p}gating_output [T, num_experts={E}], or {p}topk_ids [T, topk={K}] for an "
                                 "ids-only layer")
        for name in ("topk_ids", "topk_weights"):
            if name not in h:
                continue
            shape, dtype = h[name]
            if dtype not in _FIELD_DTYPES[name]:
                raise self._fail(p + name, f"has dtype {_dtype_name(dtype)}; expected {_dtypes_text(name)}",
                                 fix=_LAYOUT_FIX)
            if len(shape) != 2 or shape[1] != K or (T is not None and shape[0] != T):
                raise self._fail(p + name, f"has shape {list(shape)}; expected [num_tokens={T if T is not None else 'T'}, topk={K}]",
                                 fix=_LAYOUT_FIX)
            T = shape[0] if T is None else T
        if "topk_weights" in h and "topk_ids" not in h:
            raise self._fail(p + "topk_ids", "missing while topk_weights is present",
                             fix=f"add {p}topk_ids [T, topk={K}], or leave {p}topk_weights out")
        if "is_padding" in h:
            shape, dtype = h["is_padding"]
            if dtype not in _FIELD_DTYPES["is_padding"] or shape != (T,):
                raise self._fail(p + "is_padding", f"is {_dtype_name(dtype)} {list(shape)}; "
                                                   f"expected {_dtypes_text('is_padding')} [{T}]",
                                 fix=_LAYOUT_FIX)
        if "bias" in h:
            shape, dtype = h["bias"]
            if dtype not in _FIELD_DTYPES["bias"] or shape != (E,):
                raise self._fail(p + "bias", f"is {_dtype_name(dtype)} {list(shape)}; expected {_dtypes_text('bias')} [{E}]",
                                 fix=_LAYOUT_FIX)
            bias = self._file.get_tensor(p + "bias").float()
            if not torch.isfinite(bias).all():
                bad = int((~torch.isfinite(bias)).sum())
                raise self._fail(p + "bias", f"has {bad} non-finite values", fix="the bias must be finite; fix the capture")
        else:
            bias = torch.zeros(E)
        self._bias[layer] = bias
        offsets: tuple[int, ...] = (0, T)
        if "step_offsets" in h:
            shape, dtype = h["step_offsets"]
            if T == 0 and dtype in _OFFSET_DTYPES and len(shape) == 1 and shape[0] < 2:  # [0]: num_steps + 1 for no step
                rows = "gating_output" if "gating_output" in h else "topk_ids"
                raise self._fail(p + "step_offsets", f"is {_dtype_name(dtype)} {list(shape)}, but the layer holds no "
                                 f"token rows ({p}{rows} is {list(h[rows][0])}): step_offsets marks the steps of a "
                                 "layer with tokens", fix="leave step_offsets out for a layer without tokens, or "
                                                          "re-capture the trace with tokens in every layer")
            if dtype not in _FIELD_DTYPES["step_offsets"] or len(shape) != 1 or shape[0] < 2:
                raise self._fail(p + "step_offsets", f"is {_dtype_name(dtype)} {list(shape)}; "
                                                     f"expected {_dtypes_text('step_offsets')} [num_steps + 1]",
                                 fix=_LAYOUT_FIX)
            offsets = tuple(int(v) for v in self._file.get_tensor(p + "step_offsets").tolist())
            if offsets[0] != 0 or offsets[-1] != T:
                raise self._fail(p + "step_offsets", f"runs from {offsets[0]} to {offsets[-1]}; expected 0 to num_tokens={T}")
            if any(b <= a for a, b in zip(offsets, offsets[1:])):
                raise self._fail(p + "step_offsets", "is not strictly increasing (empty or negative step)")
        elif T == 0:
            offsets = (0,)
        return LayerInfo(
            layer=layer, num_tokens=T, step_offsets=offsets, gating_dtype=gating_dtype,
            has_bias="bias" in h, has_padding="is_padding" in h,
            has_recorded_ids="topk_ids" in h, has_recorded_weights="topk_weights" in h,
        )

    # -- data access ---------------------------------------------------------------------------
    def info(self, layer: int) -> LayerInfo:
        """Header facts of ``layer``. Raises KeyError for a layer the trace lacks."""
        return self._infos[layer]

    def bias(self, layer: int) -> torch.Tensor:
        """``[E]`` float32 bias of ``layer`` (zeros when the trace stores none)."""
        return self._bias[layer]

    def _read(self, name: str, start: int, stop: int) -> torch.Tensor:
        if self._file is None:
            raise RouteToolError("trace is closed", path=self.display_path)
        try:
            return self._file.get_slice(name)[start:stop]
        except (SafetensorError, OSError) as exc:
            raise self._fail(name, f"cannot read rows {start}:{stop} ({exc})", fix="the file is damaged; copy it again") from None

    def read_rows(self, layer: int, start: int, stop: int) -> Step:
        """Rows ``[start, stop)`` of ``layer`` as a :class:`Step` (index -1)."""
        info = self._infos[layer]
        p = f"layers.{layer}."
        return Step(
            layer=layer,
            index=-1,
            start=start,
            gating_output=self._read(p + "gating_output", start, stop) if info.has_logits else None,
            bias=self._bias[layer],
            is_padding=self._read(p + "is_padding", start, stop) if info.has_padding else None,
            recorded_ids=self._read(p + "topk_ids", start, stop) if info.has_recorded_ids else None,
            recorded_weights=self._read(p + "topk_weights", start, stop) if info.has_recorded_weights else None,
        )

    def steps(self, layer: int) -> Iterator[Step]:
        """Yield the captured forward steps of ``layer`` in order, reading one at a time."""
        offsets = self._infos[layer].step_offsets
        for index, (start, stop) in enumerate(zip(offsets, offsets[1:])):
            step = self.read_rows(layer, start, stop)
            step.index = index
            yield step

    @property
    def total_tokens(self) -> int:
        return sum(i.num_tokens for i in self._infos.values())


SAFETENSORS_MAX_HEADER = 100_000_000
"""The largest header the safetensors library reads (bytes)."""


def _begins_as_safetensors(path: str | os.PathLike) -> bool:
    """Whether the file begins as every safetensors file does: an 8-byte little-endian header
    length, then the header's JSON object (``{``). A file that does not is no safetensors file
    at all; one that does but cannot be read is damaged (truncated, corrupt)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
    except OSError:
        return True  # (the reader names the problem)
    return len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] > 1


def read_header(path: str | os.PathLike, shown: object = None) -> dict | None:
    """The JSON header of a safetensors file, read with routetool's strict reader
    (:func:`routetool.io.jsonstrict.loads`): a key repeated in ``__metadata__`` or a tensor given
    twice, which the safetensors library accepts (keeping the last) although its format forbids
    both, is refused, as is a header nested too deep or holding an absurdly long number.

    Returns:
        The header as a dict, or None for a file whose header the strict reader cannot reach
        (shorter than 8 bytes, a header length beyond the file or beyond
        :data:`SAFETENSORS_MAX_HEADER`, not UTF-8, not an object): the safetensors library
        then says what is wrong.

    Raises:
        RouteToolError: the file cannot be read, or the header is refused (naming the file,
            ``header`` and the problem).
    """
    shown = path if shown is None else shown
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return None
            (length,) = struct.unpack("<Q", head)
            if length > min(SAFETENSORS_MAX_HEADER, os.fstat(fh.fileno()).st_size - 8):
                return None
            data = fh.read(length)
    except OSError as exc:
        raise RouteToolError(f"cannot read file ({exc.strerror or exc})", path=shown, fix="check permissions") from None
    try:
        header = loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        return None
    except JSONProblem as exc:
        raise exc.error(shown, tensor="header", fix="the file is corrupt, or its writer does not follow the "
                                                    "safetensors format; capture or copy it again") from None
    return header if isinstance(header, dict) else None
