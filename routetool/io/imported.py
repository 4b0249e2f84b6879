"""What the readers of routing dumps return, and the pieces they share.

:class:`ImportOptions` says how to read a dump; :class:`ImportedRouting` (per-token expert ids,
or logits) and :class:`ImportedCounts` (tokens per expert) are what a reader returns, read by
:mod:`routetool.io.dumps` (JSON lines, CSV, SGLang ``.pt``, counts JSON) and
:mod:`routetool.io.engine_dumps` (the engines' own outputs) alike. This module sits below both,
so that neither imports the other back.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from routetool.errors import RouteToolError
from routetool.io.dump_options import DEFAULT_DROP_REPEATS
from routetool.io.limits import check_materialised, check_torch_archive, input_bytes
from routetool.io.tracefile import RouterConfig


def one_line(text: object, limit: int = 160) -> str:
    """The first non-empty line of ``text`` (e.g. an exception), shortened to ``limit`` characters."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    return first if len(first) <= limit else first[: limit - 3].rstrip() + "..."


@dataclass
class ImportOptions:
    """How to read a routing dump.

    Attributes:
        format: one of :data:`FORMATS` (``auto``: by extension and content).
        num_experts / topk: E and K when the file does not say (None: infer).
        skip_rows: drop the first N token rows of the file (warm-up).
        drop_repeats: drop runs of at least this many identical consecutive rows
            (0 = keep everything).
        select: for counts JSON, the named tables to use (``model`` or ``model/domain``,
            a prefix of the names' path); None = all, if they agree on E.
        model: model name to record (default: from the file or its name).
        given: the reading options the user gave (keys of :data:`READING_OPTIONS`), also
            at their default values; None: those that differ from their defaults. A format
            that does not read one of them refuses it.
        refuse_counts: None to read dumps of per-expert counts; else the fix to name when
            one is refused (``import``: a trace needs per-token ids). The refusal comes as
            soon as the dump is recognised as counts, before ``select`` and the other
            reading options are applied to it (a file of several models is refused as
            counts, not asked for ``--select``).
    """

    format: str = "auto"
    num_experts: int | None = None
    topk: int | None = None
    skip_rows: int = 0
    drop_repeats: int = DEFAULT_DROP_REPEATS
    select: str | None = None
    model: str | None = None
    given: frozenset[str] | None = None
    refuse_counts: str | None = None


def _refuse_counts(path: Path, options: ImportOptions, also: str = "") -> None:
    """Refuse a dump of per-expert counts when ``options.refuse_counts`` asks for per-token ids
    (``also``: more of the fix, e.g. the ``--select`` a file of several models needs)."""
    if options.refuse_counts is not None:
        raise RouteToolError("holds per-expert counts, not per-token expert ids: a trace cannot be made from it",
                             path=path, fix=options.refuse_counts + also)


@dataclass
class ImportedLayer:
    """The routing of one layer read from a dump: ``topk_ids`` ``[T, K]`` int32 and optional
    ``topk_weights`` ``[T, K]`` float32, or (formats that hold logits) ``gating_output``
    ``[T, E]`` float and optional ``bias`` ``[E]`` float32 with ``topk_ids`` None; ``step_offsets``
    ``[0, ..., T]``; ``positions`` ``[T]`` int64, each row's token position in its request or
    sequence where the format records it (None where it does not)."""

    topk_ids: torch.Tensor | None
    topk_weights: torch.Tensor | None
    step_offsets: list[int]
    gating_output: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int((self.topk_ids if self.topk_ids is not None else self.gating_output).shape[0])

    @property
    def num_steps(self) -> int:
        return len(self.step_offsets) - 1


@dataclass
class ImportedRouting:
    """Per-token routing read from a dump (becomes an ids-only trace).

    Attributes:
        source: the file or folder read. format: the reader used. model: model name.
        num_experts / topk: E and K. layers: layer id -> :class:`ImportedLayer`.
        rows_read: token rows found (all layers). rows_skipped: dropped by ``skip_rows``.
        rows_dropped: dropped by ``drop_repeats``; runs_dropped: in how many runs.
        notes: how E/K were found, what was ignored, and similar facts worth telling.
        step_labels: a name per step, the same for every layer (the request id of formats that
            give one step per request), or None.
        router: the router parameters, for formats that hold logits and name their routing
            (FlashInfer-Trace); None: only E and K are known.
    """

    source: str
    format: str
    model: str
    num_experts: int
    topk: int
    layers: dict[int, ImportedLayer]
    rows_read: int = 0
    rows_skipped: int = 0
    rows_dropped: int = 0
    runs_dropped: int = 0
    notes: list[str] = field(default_factory=list)
    step_labels: list[str] | None = None
    router: RouterConfig | None = None

    @property
    def num_tokens(self) -> int:
        return sum(x.num_tokens for x in self.layers.values())

    @property
    def has_logits(self) -> bool:
        """Whether the layers hold logits (a trace a kernel can route) rather than ids."""
        return any(x.gating_output is not None for x in self.layers.values())


@dataclass
class DumpStep:
    """One step (forward pass, or request for per-request formats) of one layer of a dump, as
    :func:`iter_steps` yields it: ``topk_ids`` ``[n, K]`` int32 or None, ``topk_weights``
    ``[n, K]`` float32 or None, ``gating_output`` ``[n, E]`` or None, ``bias`` ``[E]`` or None,
    ``positions`` ``[n]`` int64 or None (token positions in the request), ``label`` (e.g. the
    request id) or None, ``start``: its first row in the layer."""

    layer: int
    index: int
    start: int
    label: str | None
    topk_ids: torch.Tensor | None
    topk_weights: torch.Tensor | None
    gating_output: torch.Tensor | None
    bias: torch.Tensor | None
    positions: torch.Tensor | None


def iter_steps(imported: ImportedRouting, layers: Iterable[int] | None = None) -> Iterator[DumpStep]:
    """The steps of ``imported``, layer by layer (``layers``: those, in that order; default all,
    ascending): the one way to walk any format's routing, whatever it holds (ids, weights,
    logits) and whatever alignment it records (request labels, token positions)."""
    for layer in (sorted(imported.layers) if layers is None else layers):
        x = imported.layers[layer]
        o = x.step_offsets
        for i, (a, b) in enumerate(zip(o, o[1:])):
            def cut(t, a=a, b=b):
                return None if t is None else t[a:b]
            yield DumpStep(layer=layer, index=i, start=a,
                           label=imported.step_labels[i] if imported.step_labels is not None else None,
                           topk_ids=cut(x.topk_ids), topk_weights=cut(x.topk_weights),
                           gating_output=cut(x.gating_output), bias=x.bias, positions=cut(x.positions))


@dataclass
class ImportedCounts:
    """Tokens per expert read from a dump that has no per-token ids.

    Attributes:
        source / format / model: as in :class:`ImportedRouting`.
        num_experts: E. topk: K if known (then tokens = assignments / K), else None.
        layers: layer id -> ``[S, E]`` int64 counts of S steps (forward passes, or named
            tables such as text domains).
        step_labels: a name per step, or None.
        notes: facts worth telling.
    """

    source: str
    format: str
    model: str
    num_experts: int
    topk: int | None
    layers: dict[int, torch.Tensor]
    step_labels: list[str] | None = None
    notes: list[str] = field(default_factory=list)


def _torch_load(path: Path, fix: str = "pass an SGLang expert-distribution dump (.pt)"):
    """``torch.load(weights_only=True)`` of an SGLang dump, within the budget of its size
    (:mod:`routetool.io.limits`): what its zip records declare is checked before loading, what the
    loaded tensors hold materialised (expanded views, shared references) before anything reads it."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except FileNotFoundError:
        raise RouteToolError("no such file", path=path, fix="check the path") from None
    except OSError as exc:
        raise RouteToolError(f"cannot read ({exc.strerror or exc})", path=path, fix="check permissions") from None
    if not head:
        raise RouteToolError("is empty", path=path, fix=fix)
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        raise RouteToolError("is not a torch.save file (neither a zip archive nor a pickle)",
                             path=path, fix=f"{fix}, or the file's --format")
    size = input_bytes([path])
    check_torch_archive(path, size)
    try:
        with warnings.catch_warnings():
            # torch warns (on stderr, naming its own source file) about a pickle protocol other
            # than 2 before it loads or refuses the file; the outcome is reported in one line
            warnings.filterwarnings("ignore", message=r"Detected pickle protocol", category=UserWarning)
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - pickle errors of any kind are bad input
        raise RouteToolError(f"cannot load with torch.load(weights_only=True) ({type(exc).__name__}: "
                             f"{one_line(exc, 100)})", path=path, fix=fix) from None
    check_materialised(obj, path, size)
    return obj
