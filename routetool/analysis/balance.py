"""Load-balance analysis: experts, expert-parallel ranks, EPLB what-if, bias, capacity.

Streams a routing source layer by layer in chunks of consecutive steps (a trace through
:mod:`routetool.engine.stream`, or an imported dump), keeps per layer only ``[E]``-sized
accumulators plus one scalar per step and EP configuration, and runs the statistics with
torch on the chosen device (``cuda`` when there is one), a chunk at a time with no host sync
per step: the ``[steps, E]`` histogram of a chunk is one ``index_add_``, its EP rank loads one
``[steps, E] @ [E, N]`` product. A kernel under test still runs once per captured step. Nothing here
prints; results are dataclasses rendered by :mod:`routetool.report.balance`.

Definitions (docs/balance.md):

* *assignments*: (token, expert) pairs; a token routed to K experts makes K.
* *imbalance*: max / mean assignments per expert; *CV*: std / mean; *normalized entropy*:
  entropy / log E; *Gini* of the per-expert loads (see :func:`routetool.engine.load.load_stats`);
  all four None where there is no traffic (no assignments), as balancedness is.
* *balancedness*: mean / max assignments per EP rank (vLLM, SGLang). Per layer it is given
  for the layer's whole traffic (``balancedness``) and per step (forward pass), summarised
  over the steps as min / p10 / p50 / p90 / mean (SGLang logs the per-pass value).
* *tokens received*: distinct tokens an EP rank receives (a token sent to two experts on
  one rank is sent once), when no expert is replicated.
* *capacity*: with capacity factor f, an expert takes at most
  ``ceil(f * assignments_in_step / E)`` assignments per step (GShard/Switch ``capacity =
  f * tokens * K / E``, rounded up as DeepSpeed and Tutel do); the rest overflow (dropped).
* *TV distance*: total-variation distance ``0.5 * sum |p - q|`` between two load
  distributions (0 = same shares, 1 = disjoint experts).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from routetool.engine.compare import INVALID_REASONS, invalid_reasons
from routetool.analysis.eplb import (
    Placement,
    balancedness,
    check_eplb_config,
    contiguous_placement,
    finite_or_none,
    rebalance_experts,
)
from routetool.engine.distributed import Workers
from routetool.engine.router import Router
from routetool.engine.stream import DEFAULT_CHUNK_BYTES, Chunk, chunk_budget, plan_chunks, stream_layer
from routetool.errors import KernelError, RouteToolError
from routetool.io.dumps import ImportedCounts, ImportedRouting
from routetool.engine.load import LoadStats, load_stats
from routetool.io.trace import Trace

PHASES = ("prefill", "decode")
DEFAULT_CAPACITY_FACTORS = (1.0, 1.25, 2.0)
DEFAULT_DECODE_MAX_TOKENS = 256

"""``(gating_output [n, E], bias [E], is_padding [n] | None) -> topk_ids [n, K]``."""


# ---------------------------------------------------------------------------------------
# primitives
def _histogram(idx: torch.Tensor, bins: int) -> torch.Tensor:
    """``[bins]`` int64 counts of ``idx`` (values in ``[0, bins)``), without a host sync on GPU."""
    if idx.device.type == "cpu":
        return torch.bincount(idx, minlength=bins)
    out = torch.zeros(bins, dtype=torch.int64, device=idx.device)  # bincount would read the max back
    return out.index_add_(0, idx, torch.ones_like(idx))


def count_experts(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments per expert of ``ids`` without a host synchronisation.

    Args:
        ids: ``[n, K]`` int expert ids; entries outside ``[0, E)`` (-1 on padded rows) are
            not counted.
        num_experts: E.

    Returns:
        ``(counts [E] int64, uncounted)`` on ``ids``' device; ``uncounted`` is a 0-d int64
        tensor with the number of entries outside ``[0, E)``.
    """
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    full = _histogram(torch.where(valid, flat, num_experts), num_experts + 1)
    return full[:num_experts], full[num_experts]


def count_experts_per_step(ids: torch.Tensor, step_index: torch.Tensor, num_steps: int,
                           num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments per step and expert of a chunk of steps, in one histogram (no host sync).

    Args:
        ids: ``[n, K]`` int expert ids (entries outside ``[0, E)`` not counted).
        step_index: ``[n]`` int64, each row's step (0 .. num_steps - 1).
        num_steps: S. num_experts: E.

    Returns:
        ``(counts [S, E] int64, uncounted)``; ``uncounted`` is a 0-d int64 tensor with the
        number of entries outside ``[0, E)``.
    """
    flat = ids.long()
    valid = (flat >= 0) & (flat < num_experts)
    index = torch.where(valid, step_index[:, None] * num_experts + flat, num_steps * num_experts)
    full = _histogram(index.reshape(-1), num_steps * num_experts + 1)
    return full[:-1].view(num_steps, num_experts), full[-1]


def tokens_per_rank(ids: torch.Tensor, rank_of_expert: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Distinct tokens each EP rank receives: a row counts once per rank it has experts on.

    Up to 64 ranks, an ``[n, N]`` hit mask (fastest on the CPU); beyond, the K ranks of each
    row are sorted and only the first of equal neighbours counted (``n x K`` memory).

    Args:
        ids: ``[n, K]`` expert ids (entries outside ``[0, E)`` ignored).
        rank_of_expert: ``[E]`` int64 rank of each expert (same device).
        num_ranks: N.

    Returns:
        ``[N]`` int64.
    """
    E = rank_of_expert.numel()
    ids = ids.long()
    valid = (ids >= 0) & (ids < E)
    ranks = torch.where(valid, rank_of_expert[ids.clamp(0, E - 1)], num_ranks)
    if num_ranks <= 64:
        hit = torch.zeros(ids.shape[0], num_ranks + 1, dtype=torch.bool, device=ids.device)
        hit.scatter_(1, ranks, True)
        return hit[:, :num_ranks].sum(0)
    ranks = ranks.sort(dim=1).values
    first = torch.ones_like(ranks, dtype=torch.bool)
    first[:, 1:] = ranks[:, 1:] != ranks[:, :-1]
    return _histogram(torch.where(first, ranks, num_ranks).reshape(-1), num_ranks + 1)[:num_ranks]


def tv_distance(p: torch.Tensor, q: torch.Tensor) -> float | None:
    """Total-variation distance between two ``[E]`` load histograms (None if one is empty)."""
    p, q = p.double(), q.double()
    sp, sq = float(p.sum()), float(q.sum())
    if sp <= 0 or sq <= 0:
        return None
    return 0.5 * float((p / sp - q / sq).abs().sum())


@dataclass
class Quantiles:
    """A distribution summary (of per-step balancedness, or of per-layer values)."""

    count: int
    min: float | None
    p10: float | None
    p50: float | None
    p90: float | None
    mean: float | None

    @classmethod
    def of(cls, values: torch.Tensor) -> Quantiles:
        v = values.double().flatten()
        v = v[~torch.isnan(v)]
        if v.numel() == 0:
            return cls(0, None, None, None, None, None)
        q = torch.quantile(v, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64, device=v.device)).tolist()
        return cls(int(v.numel()), float(v.min()), q[0], q[1], q[2], float(v.mean()))


# ---------------------------------------------------------------------------------------
# sources
@dataclass
class ChunkLoad:
    """The routing of a chunk of consecutive steps of one layer, as the analysis consumes it.

    Attributes:
        first_step: the layer step of the chunk's first step.
        counts: ``[S, E]`` int64 assignments per step and expert (on the analysis device).
        num_tokens: unpadded tokens of each step, or None when unknown (counts-only input).
        phases: ``prefill`` / ``decode`` of each step, or None when it cannot be told.
        ids: ``[n, K]`` expert ids of the chunk's rows (padded rows -1), or None.
        offsets: step boundaries within ``ids``, ``[0, n_0, ..., n]`` (with ``ids``).
        bias_counts_with / bias_ids_with: for the bias effect, the routing with the trace's
            bias by the bias-effect routing (the same as ``counts``/``ids`` unless the analysed
            routing is another one, e.g. the recorded ids), or None.
        counts_nobias / ids_nobias: that routing with the bias zeroed, or None.
        uncounted: 0-d tensor, ids outside ``[0, E)`` on unpadded rows.
        invalid: ``[n, len(INVALID_REASONS)]`` bool, which of
            :data:`routetool.engine.compare.INVALID_REASONS` apply to each row of ``ids`` (from
            :func:`routetool.engine.compare.invalid_reasons`; padded rows never), or None.
        invalid_bias: ``(invalid, ids)`` of each of a kernel's routings for the bias effect, or None.
        row_start: the layer row of the chunk's first row (rows are named in the layer).
        piece: the load is part of one step's rows (a step read in pieces, or one rank's share of
            a global step): ``counts``, ``num_tokens`` and the bias counts are that part's, which
            add up; ``phases`` is None but on the step's last piece.
        ends_step: the load's last row ends its step (False for a piece whose step goes on).
    """

    first_step: int
    counts: torch.Tensor
    num_tokens: list[int] | None
    phases: list[str] | None = None
    ids: torch.Tensor | None = None
    offsets: list[int] | None = None
    bias_counts_with: torch.Tensor | None = None
    bias_ids_with: torch.Tensor | None = None
    counts_nobias: torch.Tensor | None = None
    ids_nobias: torch.Tensor | None = None
    uncounted: torch.Tensor | None = None
    invalid: torch.Tensor | None = None
    invalid_bias: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    row_start: int = 0
    piece: bool = False
    ends_step: bool = True

    @property
    def num_steps(self) -> int:
        return int(self.counts.shape[0])

    @property
    def rows(self) -> int | None:
        """Rows of ``ids`` (None without ids)."""
        return None if self.ids is None else int(self.ids.shape[0])


class Source:
    """What :func:`analyze_balance` reads: per layer, a stream of :class:`ChunkLoad`.

    Attributes:
        path: the input. kind: ``trace``, ``ids`` (imported dump) or ``counts``.
        model: model name. routing: where the ids come from, in words.
        num_experts: E. topk: K (None when unknown). layers: analysed layer ids.
        bias_effect: whether steps carry ``counts_nobias``; bias_note: why not, if not.
        notes: facts about the input worth reporting.
    """

    path: str
    kind: str
    model: str
    routing: str
    num_experts: int
    topk: int | None
    layers: list[int]
    bias_effect: bool = False
    bias_note: str = ""
    notes: list[str]
    partial: list = []
    """The traces read that hold less than a whole recording (:class:`routetool.io.run.PartialTrace`)."""

    def _init_from_dump(self, imported: ImportedRouting | ImportedCounts, routing: str,
                        layers: Sequence[int] | None, bias_note: str) -> None:
        """The attributes an imported dump gives (no logits, so no bias effect)."""
        self.imported = imported
        self.path = imported.source
        self.model = imported.model
        self.routing = routing
        self.num_experts = imported.num_experts
        self.topk = imported.topk
        self.layers = list(layers) if layers is not None else sorted(imported.layers)
        self.bias_effect = False
        self.bias_note = bias_note
        self.notes = list(imported.notes)

    def step_sizes(self, layer: int) -> list[int]:
        """Rows (or assignments for counts) per step, known before reading (for windows)."""
        raise NotImplementedError

    def step_labels(self, layer: int) -> list[str] | None:
        return None

    def chunks(self, layer: int, device: torch.device) -> Iterator[ChunkLoad]:
        raise NotImplementedError

    def invalid_error(self, layer: int, found: InvalidRows, bias_effect: bool = False) -> RouteToolError:
        """The error for unpadded rows of ``layer`` whose expert ids are invalid (bad input, exit 2)."""
        return RouteToolError(f"layer {layer}, {found.where()}: the ids {found.ids} {found.what(self.num_experts)}; "
                              f"{found.rows:,} row(s) of the layer are invalid", path=self.path,
                              fix=f"each token picks distinct experts in [0, {self.num_experts}); fix the input")


@dataclass
class InvalidRows:
    """Unpadded rows whose expert ids are invalid (:data:`routetool.engine.compare.INVALID_REASONS`
    ``id_out_of_range``, ``duplicate_id``, ``minus_one_on_unpadded_row``): how many, and the first.

    Attributes:
        rows: how many rows. step / row: where the first one is (row: its index in the
            layer, as replay counts rows). ids: its ``[K]`` ids. reasons: the reasons that apply
            to it.
    """

    rows: int
    step: int
    row: int
    ids: list[int]
    reasons: list[str]

    def where(self) -> str:
        return f"step {self.step}, row {self.row}"

    def what(self, num_experts: int) -> str:
        """The reasons in words, e.g. ``hold an id outside [0, 8)``."""
        words = {"id_out_of_range": f"an id outside [0, {num_experts})", "duplicate_id": "one expert twice",
                 "minus_one_on_unpadded_row": "-1 on an unpadded row"}
        return "hold " + " and ".join(words.get(r, r) for r in self.reasons)


_FIX_KERNEL = "fix the kernel (check it with `routetool validate`), or use --reference"

def _phase(num_tokens: int, padded: int, decode_max_tokens: int) -> str:
    return "decode" if padded > 0 or num_tokens <= decode_max_tokens else "prefill"


def _mask(ids: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    return ids if padding is None else ids.masked_fill(padding[:, None], -1)


class TraceSource(Source):
    """A routetool trace, routed by a function of the logits or by its recorded ids.

    Args:
        trace: an open :class:`~routetool.io.trace.Trace`.
        layers: layers to analyse.
        routing: ``auto`` (``route_fn`` on layers with logits, recorded ids on ids-only
            layers), ``kernel`` / ``reference`` (``route_fn``; every layer needs logits) or
            ``recorded`` (the trace's ``topk_ids``).
        route_fn: routing of logits (the kernel or the reference), a :class:`~routetool.engine.router.Router` (:func:`route_fn_from`).
        route_name: its name for reports (default: the routing's).
        nobias_fn: routing used for the bias effect (with the trace's bias and with zeros);
            needed when ``bias_effect`` is on and some layer has logits.
        nobias_name: its name for reports.
        budget_bytes: memory per chunk of steps (:mod:`routetool.engine.stream`).
        bias_effect: compute the bias effect (on the layers that have logits).
        decode_max_tokens: steps with padding or at most this many tokens are decode steps.

    Raises:
        RouteToolError: a layer lacks what the routing needs.
    """

    kind = "trace"

    def __init__(self, trace: Trace, layers: Sequence[int], routing: str = "auto", route_fn: Router | None = None,
                 route_name: str = "", nobias_fn: Router | None = None, nobias_name: str = "",
                 bias_effect: bool = True, decode_max_tokens: int = DEFAULT_DECODE_MAX_TOKENS,
                 budget_bytes: int = DEFAULT_CHUNK_BYTES):
        route_name = route_name or (route_fn.name if route_fn is not None else "kernel")
        nobias_name = nobias_name or (nobias_fn.name if nobias_fn is not None else "")
        from routetool.io.run import trace_partial

        self.budget_bytes = budget_bytes
        self.trace = trace
        self.partial = [p] if (p := trace_partial(trace)) is not None else []
        self.path = str(trace.display_path)
        self.model = trace.meta.model
        self.num_experts = trace.meta.router.num_experts
        self.topk = trace.meta.router.topk
        self.layers = list(layers)
        self.decode_max_tokens = decode_max_tokens
        self.route_fn = route_fn
        self.route_name = route_name
        self.nobias_name = nobias_name or route_name
        self.notes = []
        self._mode: dict[int, str] = {}
        for layer in self.layers:
            info = trace.info(layer)
            if routing == "recorded" or (routing == "auto" and not info.has_logits):
                if not info.has_recorded_ids:
                    raise RouteToolError("holds no recorded topk_ids", path=self.path, tensor=f"layers.{layer}.topk_ids",
                                         fix="route it from the logits: drop --recorded")
                self._mode[layer] = "recorded"
            else:
                if not info.has_logits:
                    raise RouteToolError(f"holds no gating_output (an ids-only trace): cannot route with the {routing}",
                                         path=self.path, tensor=f"layers.{layer}.gating_output",
                                         fix="drop --reference/--kernel to use the recorded ids")
                if route_fn is None:
                    raise ValueError("route_fn is needed to route logits")
                self._mode[layer] = "route"
        modes = set(self._mode.values())
        parts = []
        if "route" in modes:
            parts.append(route_name)
        if "recorded" in modes:
            parts.append("recorded topk_ids" + (" (ids-only layers)" if "route" in modes else ""))
        self.routing = " + ".join(parts)
        logits_layers = [x for x in self.layers if trace.info(x).has_logits]
        self.nobias_fn = nobias_fn
        if not bias_effect:
            self.bias_effect, self.bias_note = False, "not computed (--no-bias-effect)"
        elif not logits_layers:
            self.bias_effect = False
            self.bias_note = ("not available: the trace has no logits (ids-only), so it cannot be routed again "
                              "with the bias zeroed")
        else:
            if nobias_fn is None:
                raise ValueError("nobias_fn is needed for the bias effect of layers with logits")
            self.bias_effect = True
            self.bias_note = f"routed with {nobias_name or route_name}: trace bias vs bias zeroed"
            if len(logits_layers) < len(self.layers):
                self.bias_note += "; ids-only layers left out"
            if all(not trace.info(x).has_bias for x in logits_layers):
                self.bias_note += "; the trace stores no bias (zeros), so both routings agree"
        if not logits_layers and routing in ("auto", "recorded"):
            self.notes.append("ids-only trace: loads from the recorded topk_ids; what needs logits (bias effect) "
                              "is skipped")

    def step_sizes(self, layer: int) -> list[int]:
        o = self.trace.info(layer).step_offsets
        return [b - a for a, b in zip(o, o[1:])]

    def invalid_error(self, layer: int, found: InvalidRows, bias_effect: bool = False) -> RouteToolError:
        """Invalid ids on unpadded rows: recorded ``topk_ids`` are bad input (exit 2); a kernel's
        (``bias_effect``: its routings for the bias effect) are a finding (:class:`KernelError`
        ``invalid:<reason>``, exit 1)."""
        E = self.num_experts
        if self._mode[layer] == "route" or bias_effect:
            name = self.nobias_name if bias_effect else self.route_name
            verb = "is" if found.rows == 1 else "are"
            return KernelError(f"{name} returned invalid topk_ids on layer {layer}, {found.where()}"
                               f"{' (bias effect)' if bias_effect else ''}: {found.ids} {found.what(E)}; "
                               f"{found.rows:,} of the layer's rows {verb} invalid",
                               failure_class=f"invalid:{found.reasons[0]}", path=self.path, fix=_FIX_KERNEL)
        drop = ", or route the logits: drop --recorded" if self.trace.info(layer).has_logits else ""
        return RouteToolError(f"layer {layer}, {found.where()}: the recorded ids {found.ids} {found.what(E)}; "
                              f"{found.rows:,} unpadded row(s) of the layer are invalid", path=self.path,
                              tensor=f"layers.{layer}.topk_ids",
                              fix=f"each token picks distinct experts in [0, {E}), as `routetool import` requires of "
                                  f"dumps: fix the capture{drop}")

    def chunks(self, layer: int, device: torch.device) -> Iterator[ChunkLoad]:
        """The layer's loads, a chunk of whole steps or a piece of one step at a time: a kernel
        under test routes whole steps (read whole, up to :data:`~routetool.engine.stream.KERNEL_STEP_BYTES`),
        everything else runs over pieces of at most the budget (:meth:`Chunk.pieces`)."""
        E = self.num_experts
        mode = self._mode[layer]
        info = self.trace.info(layer)
        bias = self.trace.bias(layer).to(device)
        zeros = torch.zeros_like(bias)
        both = self.bias_effect and info.has_logits and mode == "route" and self.nobias_fn is self.route_fn
        effect = self.bias_effect and info.has_logits and not both
        kernel = mode == "route" and (_by_step(self.route_fn) or (effect and _by_step(self.nobias_fn)))
        open_rows = open_padded = 0  # of a step read in pieces, so far

        def route(router: Router, rows: Chunk, b: torch.Tensor, context: str = "", whole: bool = False):
            return router.route_or_raise(rows, b, self.path, context=context, whole_chunk=whole).ids

        def without_bias(router: Router, rows: Chunk):  # an analysis of the logits: all rows in one call
            return route(router, rows, zeros, "with the bias zeroed (bias effect)", whole=True)

        for chunk in stream_layer(self.trace, layer, device, budget_bytes=self.budget_bytes, whole_steps=kernel):
            whole: dict[str, torch.Tensor] = {}  # a kernel's routings of the whole chunk, cut per piece below
            if mode == "route" and _by_step(self.route_fn):
                whole["ids"] = route(self.route_fn, chunk, bias)
                if both:
                    whole["without"] = without_bias(self.route_fn, chunk)
            if effect and _by_step(self.nobias_fn):
                whole["with"] = route(self.nobias_fn, chunk, bias, "(bias effect)")
                whole["without"] = without_bias(self.nobias_fn, chunk)
            for piece in chunk.pieces(self.budget_bytes):
                S = piece.num_steps
                pad = piece.is_padding
                step_index = piece.step_index()
                sizes = piece.step_sizes
                if pad is not None:
                    padded = torch.zeros(S, dtype=torch.int64, device=device).index_add_(0, step_index, pad.long()).tolist()
                else:
                    padded = [0] * S
                without = chunk.rows_of(piece, whole.get("without"))
                if mode == "recorded":
                    ids = piece.recorded_ids
                elif "ids" in whole:
                    ids = chunk.rows_of(piece, whole["ids"])
                else:
                    ids = route(self.route_fn, piece, bias)
                    if both:
                        without = without_bias(self.route_fn, piece)
                masked = _mask(ids, pad)
                counts, uncounted = count_experts_per_step(masked, step_index, S, E)
                if pad is not None:
                    uncounted = uncounted - pad.sum() * ids.shape[1]
                invalid = invalid_reasons(masked, None, pad, E)
                tokens = [n - p for n, p in zip(sizes, padded)]
                if piece.whole:
                    phases = [_phase(n, p, self.decode_max_tokens) for n, p in zip(tokens, padded)]
                else:  # a piece of one step: its phase once the step's last piece is in
                    open_rows, open_padded = open_rows + sizes[0], open_padded + padded[0]
                    phases = [_phase(open_rows - open_padded, open_padded, self.decode_max_tokens)] \
                        if piece.ends_step else None
                    if piece.ends_step:
                        open_rows = open_padded = 0
                load = ChunkLoad(first_step=piece.first_step, counts=counts, num_tokens=tokens, phases=phases,
                                 ids=masked, offsets=piece.offsets, uncounted=uncounted, invalid=invalid,
                                 row_start=piece.start, piece=not piece.whole, ends_step=piece.ends_step)
                if self.bias_effect and info.has_logits:
                    if both:
                        with_bias = ids
                    elif "with" in whole:
                        with_bias = chunk.rows_of(piece, whole["with"])
                    else:
                        with_bias = route(self.nobias_fn, piece, bias, "(bias effect)")
                    if without is None:
                        without = without_bias(self.nobias_fn, piece)
                    load.bias_ids_with, load.ids_nobias = _mask(with_bias, pad), _mask(without, pad)
                    load.bias_counts_with = counts if with_bias is ids else \
                        count_experts_per_step(load.bias_ids_with, step_index, S, E)[0]
                    load.counts_nobias = count_experts_per_step(load.ids_nobias, step_index, S, E)[0]
                    if _by_step(self.nobias_fn):  # a kernel's ids are judged wherever they are used
                        load.invalid_bias = [(invalid_reasons(x, None, pad, E), x) for x in (
                            load.ids_nobias, *([load.bias_ids_with] if with_bias is not ids else []))]
                yield load


def _slice_load(load: ChunkLoad, a: int, b: int) -> ChunkLoad:
    """Steps ``[a, b)`` of a chunk (relative to its first step), rows cut at the step offsets."""
    if a == 0 and b == load.num_steps:
        return load
    o = load.offsets
    ra, rb = o[a], o[b]

    def rows(x):
        return None if x is None else x[ra:rb]

    return ChunkLoad(
        first_step=load.first_step + a, counts=load.counts[a:b],
        num_tokens=None if load.num_tokens is None else load.num_tokens[a:b],
        phases=None if load.phases is None else load.phases[a:b], ids=rows(load.ids),
        offsets=[v - ra for v in o[a:b + 1]],
        bias_counts_with=None if load.bias_counts_with is None else load.bias_counts_with[a:b],
        bias_ids_with=rows(load.bias_ids_with),
        counts_nobias=None if load.counts_nobias is None else load.counts_nobias[a:b], ids_nobias=rows(load.ids_nobias),
        uncounted=load.uncounted if a == 0 else None, row_start=load.row_start + ra)


def _sum_or_none(parts: list) -> torch.Tensor | None:
    return None if any(p is None for p in parts) else torch.stack(parts).sum(0)


def _cat_or_none(parts: list) -> torch.Tensor | None:
    return None if any(p is None for p in parts) else torch.cat(parts)


def _combine_loads(parts: list[ChunkLoad]) -> ChunkLoad:
    """The same steps of several data-parallel ranks as one chunk of global steps: counts and
    tokens added per step, the rows of every rank together (a step is prefill if any rank's is).
    Invalid rows are judged per rank before (:class:`RunSource`)."""
    if len(parts) == 1:
        load = parts[0]
        return replace(load, invalid=None, invalid_bias=None, offsets=None)
    first = parts[0]
    tokens = None if any(p.num_tokens is None for p in parts) else [sum(t) for t in zip(*(p.num_tokens for p in parts))]
    phases = None
    if all(p.phases is not None for p in parts):
        phases = ["prefill" if "prefill" in step else "decode" for step in zip(*(p.phases for p in parts))]
    uncounted = [p.uncounted for p in parts if p.uncounted is not None]
    return ChunkLoad(
        first_step=first.first_step, counts=torch.stack([p.counts for p in parts]).sum(0), num_tokens=tokens,
        phases=phases, ids=_cat_or_none([p.ids for p in parts]), offsets=None,
        bias_counts_with=_sum_or_none([p.bias_counts_with for p in parts]),
        bias_ids_with=_cat_or_none([p.bias_ids_with for p in parts]),
        counts_nobias=_sum_or_none([p.counts_nobias for p in parts]),
        ids_nobias=_cat_or_none([p.ids_nobias for p in parts]),
        uncounted=torch.stack(uncounted).sum() if uncounted else None)


class RunSource(Source):
    """The ranks of a run folder as one source: the global expert load, what EPLB balances.

    A global step ``s`` is step ``s`` of every data-parallel rank together: their counts and
    tokens add (vLLM's EPLB and SGLang's recorder sum the load over the DP ranks per forward
    pass). Ranks that route the same tokens (tensor-parallel peers of one DP rank:
    :meth:`routetool.io.run.RunInput.token_groups`) count once: the lowest rank of the group
    is read, the others are not. A rank with fewer steps adds nothing to the later ones. Each
    rank is routed as a :class:`TraceSource` of its own (same routing options) with its share
    of the memory budget, and its invalid ids are named by its own trace, step and row.

    Args:
        run: an open :class:`~routetool.io.run.RunInput`. layers: layers to analyse.
        make_source: ``(trace, layers, budget_bytes) -> TraceSource`` for one rank.
        budget_bytes: memory per chunk of steps over all ranks read together (default:
            :data:`~routetool.engine.stream.DEFAULT_CHUNK_BYTES` as it is when called).
    """

    kind = "trace"

    def __init__(self, run, layers: Sequence[int], make_source: Callable, budget_bytes: int | None = None):
        self.run = run
        self.layers = list(layers)
        self._groups = {layer: run.token_groups(layer) for layer in self.layers}
        for layer, groups in self._groups.items():  # peers route the same tokens: the same steps, at least
            for g in groups:
                first = run.ranks[g[0]]
                sizes = first.trace.info(layer).step_offsets
                for j in g[1:]:
                    peer = run.ranks[j]
                    if peer.trace.info(layer).step_offsets != sizes:
                        raise RouteToolError(
                            f"{peer.label} and {first.label} share dp_rank {first.layout['dp_rank']} (tensor-parallel "
                            f"peers, which route the same tokens) but hold different steps in layer {layer} "
                            f"({peer.trace.info(layer).num_tokens:,} and {first.trace.info(layer).num_tokens:,} rows)",
                            path=run.display_path, fix="check the ranks' dp_rank metadata")
        readers = sorted({g[0] for groups in self._groups.values() for g in groups})
        budget_bytes = chunk_budget(budget_bytes)
        share = max(min(budget_bytes, 1 << 20), budget_bytes // max(1, max(len(g) for g in self._groups.values())))
        self._sources: dict[int, TraceSource] = {}
        for i in readers:
            trace = run.ranks[i].trace
            self._sources[i] = make_source(trace, [x for x in self.layers if x in trace.layers], share)
        first = self._sources[readers[0]]
        self.path = str(run.display_path)
        self.model = first.model
        self.num_experts = first.num_experts
        self.topk = first.topk
        self.routing = first.routing
        self.bias_effect = all(src.bias_effect for src in self._sources.values())
        self.bias_note = first.bias_note
        self.notes = list(run.notes)
        self.partial = run.partial
        peers = sorted(run.ranks[j].rank for groups in self._groups.values() for g in groups for j in g[1:])
        shown = ", ".join(f"rank-{r}" for r in sorted(set(peers))[:8]) + (" ..." if len(set(peers)) > 8 else "")
        self.notes.append(f"{len(run.ranks)} ranks: the load is summed over {len(readers)} data-parallel rank(s) "
                          "step by step" + (f"; {shown} route the same tokens as a lower rank of their DP rank "
                                            "(tensor-parallel peers) and are counted once" if peers else ""))
        self._rank_totals: dict[int, dict[int, torch.Tensor]] = {}

    def readers(self, layer: int) -> list[int]:
        """Indices into the run's ranks of the ranks read for ``layer`` (one per DP rank)."""
        return [g[0] for g in self._groups[layer]]

    def step_sizes(self, layer: int) -> list[int]:
        per_rank = [self._sources[i].step_sizes(layer) for i in self.readers(layer)]
        steps = max(len(x) for x in per_rank)
        return [sum(x[s] for x in per_rank if s < len(x)) for s in range(steps)]

    def rank_totals(self, layer: int) -> dict[int, torch.Tensor]:
        """``[E]`` assignments per expert of each rank read for ``layer`` (by run rank), on the CPU,
        once its chunks are done."""
        return {self.run.ranks[i].rank: t.cpu() for i, t in self._rank_totals.get(layer, {}).items()}

    def chunks(self, layer: int, device: torch.device) -> Iterator[ChunkLoad]:
        """Global steps: the ranks' chunks cut at common step boundaries and added; a step that
        some rank reads in pieces comes as each rank's share of it, one piece at a time
        (:attr:`ChunkLoad.piece`), closed by an empty piece that carries the step's phase."""
        readers = self.readers(layer)
        streams = {i: iter(self._sources[i].chunks(layer, device)) for i in readers}
        pending: dict[int, tuple[ChunkLoad, int]] = {}
        totals = self._rank_totals[layer] = {i: torch.zeros(self.num_experts, dtype=torch.int64, device=device)
                                             for i in readers}
        checks = {i: (_FirstInvalid(device), _FirstInvalid(device)) for i in readers}

        def pull(i: int) -> ChunkLoad | None:
            load = next(streams[i], None)
            if load is None:
                del streams[i]
                return None
            totals[i] += load.counts.sum(0)
            if load.invalid is not None:
                checks[i][0].add(load.invalid, load.ids, load)
            for reasons, ids in load.invalid_bias or ():
                checks[i][1].add(reasons, ids, load)
            return load

        def share(load: ChunkLoad) -> ChunkLoad:  # a rank's part of a global step read in pieces
            return replace(load, invalid=None, invalid_bias=None, offsets=None, phases=None, piece=True,
                           ends_step=False)

        while True:
            for i in list(streams):
                if i not in pending:
                    load = pull(i)
                    if load is not None:
                        pending[i] = (load, 0)
            if not pending:
                break
            start = min(load.first_step + at for load, at in pending.values())
            if any(load.piece for load, _ in pending.values()):  # step `start` in shares, piece by piece
                phases: list[str | None] = []
                tokens_known = True
                for i in sorted(pending):
                    load, at = pending.pop(i)
                    if not load.piece:
                        part = _slice_load(load, at, at + 1)
                        phases.append(part.phases[0] if part.phases is not None else None)
                        tokens_known &= part.num_tokens is not None
                        yield share(part)
                        if at + 1 < load.num_steps:
                            pending[i] = (load, at + 1)
                        continue
                    while load is not None:
                        tokens_known &= load.num_tokens is not None
                        yield share(load)
                        if load.ends_step:
                            phases.append(load.phases[0] if load.phases is not None else None)
                            break
                        load = pull(i)
                phase = None if None in phases else ["prefill" if "prefill" in phases else "decode"]
                z = torch.zeros(1, self.num_experts, dtype=torch.int64, device=device)
                yield ChunkLoad(first_step=start, counts=z, num_tokens=[0] if tokens_known else None, phases=phase,
                                bias_counts_with=z if self.bias_effect else None,
                                counts_nobias=z if self.bias_effect else None, piece=True, ends_step=True)
                continue
            end = min(load.first_step + load.num_steps for load, _ in pending.values())
            parts = []
            for i in sorted(pending):
                load, at = pending[i]
                parts.append(_slice_load(load, at, at + end - start))
                if load.first_step + load.num_steps == end:
                    del pending[i]
                else:
                    pending[i] = (load, at + end - start)
            yield _combine_loads(parts)
        for i in readers:
            for bias_effect, check in zip((False, True), checks[i]):
                found = check.found()
                if found is not None:
                    raise self._sources[i].invalid_error(layer, found, bias_effect=bias_effect)


class ImportedSource(Source):
    """Per-token ids read from a dump (:class:`~routetool.io.dumps.ImportedRouting`)."""

    kind = "ids"

    def __init__(self, imported: ImportedRouting, layers: Sequence[int] | None = None,
                 decode_max_tokens: int = DEFAULT_DECODE_MAX_TOKENS):
        self._init_from_dump(imported, f"imported ids ({imported.format})", layers,
                             "not available: an imported dump holds expert ids, not logits")
        self.decode_max_tokens = decode_max_tokens

    def step_sizes(self, layer: int) -> list[int]:
        o = self.imported.layers[layer].step_offsets
        return [b - a for a, b in zip(o, o[1:])]

    def chunks(self, layer: int, device: torch.device) -> Iterator[ChunkLoad]:
        x = self.imported.layers[layer]
        o = x.step_offsets
        E = self.num_experts
        for first, end in plan_chunks(o, 8 * max(1, x.topk_ids.shape[1]) + 4 * E, DEFAULT_CHUNK_BYTES):
            a, b = o[first], o[end]
            ids = x.topk_ids[a:b].to(device)
            offsets = [v - a for v in o[first:end + 1]]
            sizes = [q - p for p, q in zip(offsets, offsets[1:])]
            step_index = torch.repeat_interleave(torch.arange(len(sizes), device=device),
                                                 torch.tensor(sizes, device=device), output_size=b - a)
            counts, uncounted = count_experts_per_step(ids, step_index, len(sizes), E)
            yield ChunkLoad(first_step=first, counts=counts, num_tokens=sizes,
                            phases=[_phase(n, 0, self.decode_max_tokens) for n in sizes], ids=ids, offsets=offsets,
                            uncounted=uncounted, invalid=invalid_reasons(ids, None, None, E), row_start=a)


class CountsSource(Source):
    """Per-step expert counts read from a dump (:class:`~routetool.io.dumps.ImportedCounts`)."""

    kind = "counts"

    def __init__(self, imported: ImportedCounts, layers: Sequence[int] | None = None):
        self._init_from_dump(imported, f"expert counts ({imported.format})", layers,
                             "not available: the input holds expert counts, not logits")

    def step_sizes(self, layer: int) -> list[int]:
        return [int(v) for v in self.imported.layers[layer].sum(1).tolist()]

    def step_labels(self, layer: int) -> list[str] | None:
        return self.imported.step_labels

    def chunks(self, layer: int, device: torch.device) -> Iterator[ChunkLoad]:
        m = self.imported.layers[layer]
        K = self.topk
        step_rows = max(1, DEFAULT_CHUNK_BYTES // (8 * max(1, m.shape[1])))
        for first in range(0, m.shape[0], step_rows):
            c = m[first:first + step_rows]
            yield ChunkLoad(first_step=first, counts=c.to(device),
                            num_tokens=[int(v) // K for v in c.sum(1).tolist()] if K else None)


# ---------------------------------------------------------------------------------------
# options and results
@dataclass
class EplbOptions:
    """EPLB what-if configuration (see :func:`routetool.analysis.eplb.rebalance_experts`).

    Attributes:
        num_redundant: R redundant experts (None = one per GPU).
        num_gpus: G (None = the first EP size). num_nodes / num_groups: as in EPLB.
        policy: ``auto`` | ``hierarchical`` | ``global``.
    """

    num_redundant: int | None = None
    num_gpus: int | None = None
    num_nodes: int = 1
    num_groups: int = 1
    policy: str = "auto"


@dataclass
class BalanceOptions:
    """What :func:`analyze_balance` computes.

    Attributes:
        ep_sizes: EP sizes to simulate with contiguous placement (each must divide E).
        placement: an extra placement to simulate (from a placement file), or None.
        windows: number of windows (consecutive steps of about equal size) for drift.
        capacity_factors: capacity factors to evaluate.
        top_n: hottest experts to list.
        eplb: EPLB what-if, or None to skip it.
    """

    ep_sizes: list[int] = field(default_factory=lambda: [8])
    placement: Placement | None = None
    windows: int = 8
    capacity_factors: list[float] = field(default_factory=lambda: list(DEFAULT_CAPACITY_FACTORS))
    top_n: int = 5
    eplb: EplbOptions | None = field(default_factory=EplbOptions)


@dataclass
class RankLoad:
    """One layer under one EP placement.

    Attributes:
        placement: the placement's name. num_ranks: N.
        assignments: ``[N]`` assignments per rank (fractional with replicas: a replicated
            expert's tokens are split evenly).
        tokens_received: ``[N]`` distinct tokens per rank, or None (replicas or no ids).
        balancedness: mean / max of ``assignments`` (whole layer), None if empty.
        step_balancedness: per-step balancedness summarised over steps.
        hottest_rank: rank with the most assignments; hottest_share: its fraction of all;
            both None when the layer has no assignments.
    """

    placement: str
    num_ranks: int
    assignments: list[float]
    tokens_received: list[int] | None
    balancedness: float | None
    step_balancedness: Quantiles
    hottest_rank: int | None
    hottest_share: float | None


@dataclass
class WindowLoad:
    """Load of a window of consecutive steps of one layer.

    Attributes:
        index, first_step, last_step, label: where it is. tokens: unpadded tokens (None
        when unknown, e.g. counts without topk; the windows of a layer sum to its tokens).
        assignments: total assignments.
        imbalance, cv: of the window's expert histogram (None without assignments). balancedness: at the first EP
        placement. tv_distance: from the layer's whole-traffic distribution.
        top_expert: the busiest expert of the window.
    """

    index: int
    first_step: int
    last_step: int
    label: str
    tokens: int | None
    assignments: int
    imbalance: float | None
    cv: float | None
    balancedness: float | None
    tv_distance: float | None
    top_expert: int | None


@dataclass
class PhaseLoad:
    """Load of the prefill or decode steps of one layer (same fields as a window)."""

    phase: str
    steps: int
    tokens: int
    assignments: int
    imbalance: float | None
    cv: float | None
    balancedness: float | None
    step_balancedness_mean: float | None
    top_expert: int | None


@dataclass
class CapacityLoad:
    """Overflow of one layer at one capacity factor.

    Attributes:
        factor: capacity factor. overflow: ``[E]`` assignments over capacity per expert,
        summed over steps. dropped: their total; dropped_fraction: of all assignments.
        experts_overflowing: experts that overflowed in at least one step.
        steps_overflowing: steps where some expert overflowed.
    """

    factor: float
    overflow: list[int]
    dropped: int
    dropped_fraction: float | None
    experts_overflowing: int
    steps_overflowing: int


@dataclass
class BiasEffect:
    """Load of one layer routed with the trace's bias and with the bias zeroed.

    Attributes:
        counts_with / counts_without: ``[E]`` assignments. load_with / load_without: their
        statistics. balancedness_with / _without: whole-layer, first EP placement.
        step_balancedness_with / _without: mean per-step balancedness, first placement.
        changed_fraction: fraction of (token, expert) picks that differ.
    """

    counts_with: list[int]
    counts_without: list[int]
    load_with: LoadStats
    load_without: LoadStats
    balancedness_with: float | None
    balancedness_without: float | None
    step_balancedness_with: float | None
    step_balancedness_without: float | None
    changed_fraction: float | None


@dataclass
class EplbLayer:
    """EPLB what-if of one layer.

    Attributes:
        balancedness_before / _after: whole-layer, contiguous placement vs EPLB placement
        (fitted on this same traffic: in-sample). max_rank_load_before / _after: tokens.
        window_balancedness_before / _after: mean over windows (placement fitted on all).
        holdout_before / _after: placement fitted on the first half of the windows,
        evaluated on the second half (out-of-sample), None with fewer than 2 windows.
        replicated: ``(logical expert, replicas)`` of the replicated experts.
        rank_load_before / _after: ``[G]`` assignments per GPU, whole layer.
    """

    layer: int
    balancedness_before: float | None
    balancedness_after: float | None
    max_rank_load_before: float
    max_rank_load_after: float
    window_balancedness_before: float | None
    window_balancedness_after: float | None
    holdout_before: float | None
    holdout_after: float | None
    replicated: list[tuple[int, int]]
    rank_load_before: list[float] = field(default_factory=list)
    rank_load_after: list[float] = field(default_factory=list)


@dataclass
class EplbResult:
    """EPLB what-if over all layers: configuration, per-layer results, the placement.

    Attributes:
        summary_before / _after: quantiles over layers of the in-sample balancedness (placement
        fitted on the traffic it is judged on).
        holdout_before / _after: quantiles over layers of the held-out balancedness (fitted on
        the first half of the windows, judged on the second); count 0 without 2 windows.
        pays_held_out: the held-out mean over layers after > before (EPLB's placement beats the
        contiguous one on traffic it was not fitted on); None without held-out numbers. The
        summary's statistic is the mean over layers, in-sample and held-out alike.
    """

    num_redundant: int
    num_gpus: int
    num_nodes: int
    num_groups: int
    policy: str
    layers: list[EplbLayer]
    placement: Placement
    summary_before: Quantiles
    summary_after: Quantiles
    holdout_before: Quantiles | None = None
    holdout_after: Quantiles | None = None
    pays_held_out: bool | None = None


@dataclass
class LayerBalance:
    """Everything about one layer.

    Attributes:
        layer, num_steps, tokens (unpadded; None if unknown), assignments.
        uncounted: ids outside ``[0, E)`` on unpadded rows (0 for sane input).
        counts: ``[E]`` assignments per expert. load: their statistics.
        ranks: one :class:`RankLoad` per EP placement (contiguous sizes, then the file).
        windows / phases: drift. phase_tv_distance: prefill vs decode distribution.
        capacity: one :class:`CapacityLoad` per factor. bias: or None.
    """

    layer: int
    num_steps: int
    tokens: int | None
    assignments: int
    uncounted: int
    counts: list[int]
    load: LoadStats
    ranks: list[RankLoad]
    windows: list[WindowLoad]
    phases: list[PhaseLoad]
    phase_tv_distance: float | None
    capacity: list[CapacityLoad]
    bias: BiasEffect | None


@dataclass
class EpSummary:
    """One EP placement over all layers.

    Attributes:
        placement, num_ranks. balancedness: per-layer whole-layer balancedness summarised
        over layers. step_balancedness_mean: mean over layers of the mean per-step
        balancedness (SGLang's "average balancedness"). worst_layer: lowest balancedness.
    """

    placement: str
    num_ranks: int
    balancedness: Quantiles
    step_balancedness_mean: float | None
    worst_layer: int | None


@dataclass
class RankShare:
    """One data-parallel rank's own load in a run folder (over the analysed layers).

    Attributes:
        rank: the run's rank. role: its place (``dp 1 tp 0``), or "". assignments: its
        (token, expert) pairs. share: of the global load. imbalance / cv / hottest: of its
        per-expert load. tv_from_global: TV distance of its expert shares from the global ones.
    """

    rank: int
    role: str
    assignments: int
    share: float | None
    imbalance: float | None
    cv: float | None
    hottest: int | None
    tv_from_global: float | None


@dataclass
class BalanceResult:
    """What ``routetool balance`` found (rendered by :mod:`routetool.report.balance`).

    ``ranks``: each read rank's own load, for a run folder (None otherwise); ``world_size``:
    the processes it ran on (torchrun; 1 alone).
    """

    source: str
    kind: str
    model: str
    routing: str
    num_experts: int
    topk: int | None
    device: str
    layers: list[LayerBalance]
    total_counts: list[int]
    total_load: LoadStats
    ep: list[EpSummary]
    eplb: EplbResult | None
    eplb_note: str
    bias_note: str
    capacity_factors: list[float]
    notes: list[str]
    elapsed_s: float
    rows: int
    ranks: list[RankShare] | None = None
    world_size: int = 1
    partial: list = field(default_factory=list)
    """The traces read that hold less than a whole recording (:class:`routetool.io.run.PartialTrace`)."""

    @property
    def token_layers_per_s(self) -> float | None:
        return self.rows / self.elapsed_s if self.elapsed_s > 0 else None


# ---------------------------------------------------------------------------------------
# the analysis
def window_of_steps(sizes: Sequence[int], windows: int) -> tuple[list[int], int]:
    """Split steps into at most ``windows`` runs of consecutive steps of about equal size.

    Windows are cut by rows (``sizes``: rows per step, padded rows of a trace included, or
    assignments for counts): step ``s`` goes to window ``floor(W * mid_s / total)``, with
    ``mid_s`` the row at the middle of the step; a window no step's middle falls in is empty
    and dropped, and the rest renumbered, so there can be fewer than ``windows`` (never more
    than there are steps).

    Returns:
        ``(window index of every step, number of windows)``.
    """
    total = sum(sizes)
    W = max(1, min(windows, len(sizes)))
    raw, start = [], 0
    for s in sizes:
        raw.append(min(W - 1, (W * (2 * start + s)) // (2 * total)) if total else 0)
        start += s
    renum = {w: i for i, w in enumerate(sorted(set(raw)))}
    return [renum[w] for w in raw], len(renum)


class _FirstInvalid:
    """Invalid rows of a layer's ids, counted, and the first one kept, on the device (read back once)."""

    def __init__(self, device: torch.device):
        z = dict(dtype=torch.int64, device=device)
        self.device = device
        self.rows = torch.zeros((), **z)
        self.step = torch.full((), -1, **z)
        self.row = torch.full((), -1, **z)
        self.ids: torch.Tensor | None = None
        self.reasons = torch.zeros(len(INVALID_REASONS), dtype=torch.bool, device=device)

    def add(self, reasons: torch.Tensor, ids: torch.Tensor | None, load: ChunkLoad) -> None:
        if not reasons.shape[0] or ids is None:
            return
        bad = reasons.any(-1)
        self.rows += bad.sum()
        r = bad.to(torch.int32).argmax()  # the first invalid row (0 when there is none)
        take = bad[r] & (self.step < 0)
        if self.ids is None:
            self.ids = torch.zeros(ids.shape[1], dtype=torch.int64, device=self.device)
        offsets = torch.tensor(load.offsets, dtype=torch.int64, device=self.device)
        step = load.first_step + torch.searchsorted(offsets, r.long(), right=True) - 1
        self.step = torch.where(take, step, self.step)
        self.row = torch.where(take, r + load.row_start, self.row)
        self.ids = torch.where(take, ids[r].long(), self.ids)
        self.reasons = torch.where(take, reasons[r], self.reasons)

    def found(self) -> InvalidRows | None:
        rows = int(self.rows)
        if not rows:
            return None
        return InvalidRows(rows=rows, step=int(self.step), row=int(self.row), ids=self.ids.tolist(),
                           reasons=[n for n, on in zip(INVALID_REASONS, self.reasons.tolist()) if on])


class _LayerAccumulator:
    """Device-side accumulators of one layer, fed a chunk of steps at a time (no host sync per step)."""

    def __init__(self, E: int, placements: list[Placement], layer: int, num_steps: int, window_of: list[int],
                 num_windows: int, factors: list[float], device: torch.device, bias: bool):
        self.E = E
        self.device = device
        z = dict(dtype=torch.int64, device=device)
        self.total = torch.zeros(E, **z)
        self.windows = torch.zeros(num_windows, E, **z)
        self.phases = torch.zeros(len(PHASES), E, **z)
        self.window_of = window_of
        self.window_index = torch.tensor(window_of, **z)
        self.uncounted = torch.zeros((), **z)
        self.shares = [p.share_matrix(layer).to(device) for p in placements]
        rank_of = [p.rank_of_expert(layer) for p in placements]
        self.rank_of = [r.to(device) if r is not None else None for r in rank_of]
        self.rank_totals = [torch.zeros(p.num_gpus, dtype=torch.float64, device=device) for p in placements]
        self.received = [torch.zeros(p.num_gpus, **z) if r is not None else None for p, r in zip(placements, rank_of)]
        self.step_bal = torch.full((len(placements), max(num_steps, 1)), float("nan"), dtype=torch.float64, device=device)
        self.step_phase = [None] * num_steps
        self.tokens = 0
        self.tokens_known = True
        self.phase_tokens = [0, 0]
        self.phase_steps = [0, 0]
        self.factors = torch.tensor(factors, dtype=torch.float64, device=device)
        self.overflow = torch.zeros(len(factors), E, **z)
        self.overflow_steps = torch.zeros(len(factors), **z)
        self.overflow_any = torch.zeros(len(factors), E, dtype=torch.bool, device=device)
        self.bias = bias
        if bias:
            self.nb_total = torch.zeros(E, **z)
            self.wb_total = torch.zeros(E, **z)
            self.step_bal_nb = torch.full((2, max(num_steps, 1)), float("nan"), dtype=torch.float64, device=device)
            self.changed = torch.zeros((), **z)
            self.picks = 0
        self.ids_seen = False
        self.steps = 0
        self.window_tokens: list[int | None] = [0] * num_windows
        self.invalid = _FirstInvalid(device)
        self.invalid_bias = _FirstInvalid(device)
        self._open: ChunkLoad | None = None  # the step read in pieces so far

    def add(self, load: ChunkLoad) -> None:
        """Add a chunk of whole steps, or a piece of one step: its rows are counted now, its
        step's figures (balancedness, capacity, phases, windows) once the step's last piece is in,
        on the counts of all its pieces."""
        self._rows(load)
        if not load.piece:
            self._steps(load)
            return
        o = self._open
        if o is None:
            o = self._open = ChunkLoad(first_step=load.first_step, counts=torch.zeros_like(load.counts),
                                       num_tokens=[0] if load.num_tokens is not None else None)
        o.counts = o.counts + load.counts
        if load.num_tokens is None or o.num_tokens is None:
            o.num_tokens = None
        else:
            o.num_tokens = [o.num_tokens[0] + load.num_tokens[0]]
        for name in ("bias_counts_with", "counts_nobias"):
            part = getattr(load, name)
            if part is not None:
                setattr(o, name, part.clone() if getattr(o, name) is None else getattr(o, name) + part)
        if load.ends_step:
            o.phases = load.phases
            self._open = None
            self._steps(o)

    def _rows(self, load: ChunkLoad) -> None:
        """What is per row: out-of-range ids, invalid rows, tokens received per EP rank, ids the bias changes."""
        if load.uncounted is not None:
            self.uncounted += load.uncounted
        if load.invalid is not None:
            self.invalid.add(load.invalid, load.ids, load)
        for reasons, ids in load.invalid_bias or ():
            self.invalid_bias.add(reasons, ids, load)
        if load.ids is not None:
            for i, r in enumerate(self.rank_of):
                if r is not None:
                    self.ids_seen = True
                    self.received[i] += tokens_per_rank(load.ids, r, self.rank_totals[i].numel())
        if self.bias and load.counts_nobias is not None and load.bias_ids_with is not None \
                and load.ids_nobias is not None:
            a, b = load.bias_ids_with.long(), load.ids_nobias.long()
            same = (a[:, :, None] == b[:, None, :]).any(-1) & (a >= 0)
            self.changed += ((a >= 0).sum() - same.sum())

    def _steps(self, load: ChunkLoad) -> None:
        """What is per step, on whole steps' counts."""
        C = load.counts
        S, s0 = load.num_steps, load.first_step
        s1 = s0 + S
        self.steps += S
        self.total += C.sum(0)
        self.windows.index_add_(0, self.window_index[s0:s1], C)
        if load.num_tokens is None:
            self.tokens_known = False
            for s in range(s0, s1):
                self.window_tokens[self.window_of[s]] = None
        else:
            self.tokens += sum(load.num_tokens)
            for s, n in zip(range(s0, s1), load.num_tokens):
                w = self.window_of[s]
                if self.window_tokens[w] is not None:
                    self.window_tokens[w] += n
        if load.phases is not None:
            index = [PHASES.index(p) for p in load.phases]
            self.phases.index_add_(0, torch.tensor(index, dtype=torch.int64, device=self.device), C)
            for s, p, n in zip(range(s0, s1), index, load.num_tokens or [0] * S):
                self.phase_tokens[p] += n
                self.phase_steps[p] += 1
                self.step_phase[s] = p
        cf = C.double()
        for i, m in enumerate(self.shares):
            rl = cf @ m
            self.rank_totals[i] += rl.sum(0)
            self.step_bal[i, s0:s1] = balancedness(rl)
        # capacity: ceil(f * assignments / E) per expert and step
        cap = torch.ceil(self.factors[None, :] * cf.sum(1)[:, None] / self.E - 1e-9)  # [S, F]
        over = (cf[:, None, :] - cap[:, :, None]).clamp(min=0).long()  # [S, F, E]
        self.overflow += over.sum(0)
        self.overflow_any |= (over > 0).any(0)
        self.overflow_steps += (over.sum(2) > 0).sum(0)
        if self.bias and load.counts_nobias is not None:
            with_c = load.bias_counts_with
            self.wb_total += with_c.sum(0)
            self.nb_total += load.counts_nobias.sum(0)
            if self.shares:
                self.step_bal_nb[0, s0:s1] = balancedness(with_c.double() @ self.shares[0])
                self.step_bal_nb[1, s0:s1] = balancedness(load.counts_nobias.double() @ self.shares[0])
            self.picks += S


def _stats_row(counts: torch.Tensor) -> tuple[float | None, float | None, int | None]:
    st = load_stats(counts, top_n=1)
    return st.imbalance, st.cv, (st.hottest[0][0] if st.hottest else None)


def _no_traffic_note(source: str, empty: list[int], num_layers: int, eplb: bool) -> str:
    """The note for analysed layers that hold no assignments (all of them, or some)."""
    if len(empty) == num_layers:
        return (f"{source} holds no traffic (0 assignments in the analysed layers): its load statistics and "
                "balancedness are undefined (-, null in JSON)"
                + ("; EPLB placed the experts as for an even load (nothing to fit)" if eplb else ""))
    names = ", ".join(map(str, empty[:20])) + (" ..." if len(empty) > 20 else "")
    return (f"layer(s) {names} hold no traffic (0 assignments): their load statistics and balancedness are "
            "undefined (-, null in JSON)" + ("; EPLB placed their experts as for an even load" if eplb else ""))


def analyze_balance(
    source: Source,
    options: BalanceOptions,
    device: torch.device | str = "cpu",
    progress: Callable[[int], None] | None = None,
    workers: Workers | None = None,
) -> BalanceResult:
    """Stream ``source`` once and compute every load-balance statistic.

    Args:
        source: a :class:`TraceSource`, :class:`RunSource`, :class:`ImportedSource` or :class:`CountsSource`.
        options: what to compute (EP sizes, placement file, windows, capacity, EPLB).
        device: where the statistics run (``cuda`` when available is the CLI's default).
        progress: called with the rows (or steps for counts) done after each chunk.
        workers: the processes to share the layers among (torchrun,
            :mod:`routetool.engine.distributed`); each layer is one unit, the EPLB what-if and
            the summaries run on the gathered layers. Default: this process alone.

    Returns:
        A :class:`BalanceResult`.

    Raises:
        RouteToolError: an EP size that does not divide E, an impossible EPLB
            configuration, a placement made for another expert count; unpadded rows of
            recorded or imported ids that are invalid (out of range, -1, one expert twice),
            named by layer, step and row.
        KernelError: the routing function failed or returned wrong or invalid outputs
            (the one kernel contract, :mod:`routetool.engine.contract`), or invalid ids.
    """
    device = torch.device(device)
    E = source.num_experts
    layers = list(source.layers)
    if not layers:
        raise RouteToolError("no layer to analyse", path=source.path, fix="check --layers")
    placements = [contiguous_placement(layers, E, n) for n in options.ep_sizes]
    if options.placement is not None:
        if options.placement.num_logical != E:
            raise RouteToolError(f"the placement is for {options.placement.num_logical} experts, the input has {E}",
                                 fix="use a placement made for this model")
        placements.append(options.placement)
    eplb_note = ""
    if options.eplb is not None:
        eo = options.eplb
        gpus = eo.num_gpus or (options.ep_sizes[0] if options.ep_sizes else None)
        if gpus is None:
            raise RouteToolError("EPLB needs a GPU count", fix="pass --gpus or --ep-size")
        redundant = eo.num_redundant if eo.num_redundant is not None else gpus
        check_eplb_config(E, redundant, eo.num_groups, eo.num_nodes, gpus, eo.policy,
                          redundant_implied_by=None if eo.num_redundant is not None
                          else "--gpus" if eo.num_gpus else "--ep-size")
        if E % gpus:
            raise RouteToolError(f"EPLB: {E} experts cannot be placed contiguously on {gpus} GPUs for the 'before' figure",
                                 fix="choose --gpus dividing the expert count")
    notes = list(source.notes)
    t0 = time.perf_counter()

    def analyse_layer(layer: int) -> tuple:
        sizes = source.step_sizes(layer)
        window_of, W = window_of_steps(sizes, options.windows)
        acc = _LayerAccumulator(E, placements, layer, len(sizes), window_of, W, options.capacity_factors, device,
                                source.bias_effect)
        for load in source.chunks(layer, device):
            acc.add(load)
            if progress is not None:
                progress((load.rows or 0) if load.piece else sum(sizes[load.first_step:load.first_step + load.num_steps]))
        found = acc.invalid.found()  # one read-back per layer
        if found is not None:
            raise source.invalid_error(layer, found)
        found = acc.invalid_bias.found()
        if found is not None:
            raise source.invalid_error(layer, found, bias_effect=True)
        res = _finish_layer(layer, acc, placements, source, options, sizes)
        rows = sum(sizes) if source.kind != "counts" else len(sizes)
        per_rank = source.rank_totals(layer) if isinstance(source, RunSource) else None
        return res, acc.total.cpu(), acc.windows.cpu(), rows, per_rank

    parts = (workers or Workers()).run(layers, analyse_layer)
    results = [p[0] for p in parts]
    total = torch.stack([p[1] for p in parts]).sum(0)
    window_counts = {layer: p[2] for layer, p in zip(layers, parts)}
    rows = sum(p[3] for p in parts)
    uncounted_total = sum(r.uncounted for r in results)
    rank_shares = _rank_shares(source, [p[4] for p in parts], total) if isinstance(source, RunSource) else None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    empty = [r.layer for r in results if r.assignments == 0]
    if empty:  # before the others when nothing at all was routed: it says what every '-' means
        notes.insert(0 if len(empty) == len(results) else len(notes),
                     _no_traffic_note(source.path, empty, len(results), options.eplb is not None))
    if uncounted_total:
        notes.append(f"{uncounted_total:,} expert ids outside [0, {E}) on unpadded rows were not counted")

    eplb = None
    if options.eplb is not None:
        eplb = _eplb_whatif(layers, results, window_counts, options, E)
    elif not eplb_note:
        eplb_note = "not computed (--no-eplb)"
    ep = []
    for i, p in enumerate(placements):
        per_layer = torch.tensor([r.ranks[i].balancedness if r.ranks[i].balancedness is not None else float("nan")
                                  for r in results], dtype=torch.float64)
        step_means = [r.ranks[i].step_balancedness.mean for r in results if r.ranks[i].step_balancedness.mean is not None]
        q = Quantiles.of(per_layer)
        worst = None
        if q.count:
            worst = results[int(torch.nan_to_num(per_layer, nan=2.0).argmin())].layer
        ep.append(EpSummary(placement=p.name, num_ranks=p.num_gpus, balancedness=q,
                            step_balancedness_mean=sum(step_means) / len(step_means) if step_means else None,
                            worst_layer=worst))
    elapsed = time.perf_counter() - t0
    total_cpu = total
    return BalanceResult(
        source=source.path, kind=source.kind, model=source.model, routing=source.routing, num_experts=E,
        topk=source.topk, device=str(device), layers=results, total_counts=total_cpu.tolist(),
        total_load=load_stats(total_cpu, top_n=options.top_n), ep=ep, eplb=eplb, eplb_note=eplb_note,
        bias_note=source.bias_note, capacity_factors=list(options.capacity_factors), notes=notes,
        elapsed_s=elapsed, rows=rows, ranks=rank_shares, world_size=(workers or Workers()).world_size,
        partial=list(source.partial),
    )


def _rank_shares(source: RunSource, per_layer: list[dict[int, torch.Tensor]], total: torch.Tensor) -> list[RankShare]:
    """Each read rank's load over the analysed layers, against the global load ``total``."""
    by_rank: dict[int, torch.Tensor] = {}
    for layer_totals in per_layer:
        for rank, counts in layer_totals.items():
            by_rank[rank] = by_rank.get(rank, 0) + counts
    whole = int(total.sum())
    g = total.double() / whole if whole else None
    out = []
    roles = {r.rank: r.role for r in source.run.ranks}
    for rank in sorted(by_rank):
        counts = by_rank[rank]
        n = int(counts.sum())
        st = load_stats(counts, top_n=1)
        out.append(RankShare(rank=rank, role=roles.get(rank, ""), assignments=n,
                             share=n / whole if whole else None, imbalance=st.imbalance, cv=st.cv,
                             hottest=st.hottest[0][0] if st.hottest else None,
                             tv_from_global=tv_distance(counts.double() / n, g) if n and g is not None else None))
    return out


def _finish_layer(layer: int, acc: _LayerAccumulator, placements: list[Placement], source: Source,
                  options: BalanceOptions, sizes: list[int]) -> LayerBalance:
    total = acc.total.cpu()
    assignments = int(total.sum())
    ranks = []
    step_bal = acc.step_bal.cpu()
    for i, p in enumerate(placements):
        rt = acc.rank_totals[i].cpu()
        hot = int(torch.argmax(rt)) if rt.numel() and rt.sum() > 0 else None
        recv = acc.received[i].cpu().tolist() if acc.received[i] is not None and acc.ids_seen else None
        ranks.append(RankLoad(
            placement=p.name, num_ranks=p.num_gpus, assignments=rt.tolist(), tokens_received=recv,
            balancedness=finite_or_none(balancedness(rt)), step_balancedness=Quantiles.of(step_bal[i, :acc.steps]),
            hottest_rank=hot, hottest_share=float(rt[hot] / rt.sum()) if hot is not None else None,
        ))
    # windows
    wc = acc.windows.cpu()
    labels = source.step_labels(layer)
    first_last: dict[int, list[int]] = {}
    for s, w in enumerate(acc.window_of):
        first_last.setdefault(w, [s, s])[1] = s
    share0 = acc.shares[0].cpu() if acc.shares else None
    windows = []
    for w in range(wc.shape[0]):
        a, b = first_last[w]
        imb, cv, top = _stats_row(wc[w])
        label = (labels[a] if a == b else f"{labels[a]}..{labels[b]}") if labels else \
            (f"step {a}" if a == b else f"steps {a}-{b}")
        windows.append(WindowLoad(
            index=w, first_step=a, last_step=b, label=label,
            tokens=acc.window_tokens[w],  # unpadded tokens: the windows sum to the layer's tokens
            assignments=int(wc[w].sum()), imbalance=imb, cv=cv,
            balancedness=finite_or_none(balancedness(wc[w].double() @ share0)) if share0 is not None else None,
            tv_distance=tv_distance(wc[w], total), top_expert=top,
        ))
    # phases
    phases = []
    pc = acc.phases.cpu()
    for p, name in enumerate(PHASES):
        if acc.phase_steps[p] == 0:
            continue
        imb, cv, top = _stats_row(pc[p])
        mask = torch.tensor([acc.step_phase[s] == p for s in range(acc.steps)], dtype=torch.bool)
        sb = step_bal[0, :acc.steps][mask] if share0 is not None else torch.empty(0)
        sb = sb[~torch.isnan(sb)]
        phases.append(PhaseLoad(
            phase=name, steps=acc.phase_steps[p], tokens=acc.phase_tokens[p], assignments=int(pc[p].sum()),
            imbalance=imb, cv=cv,
            balancedness=finite_or_none(balancedness(pc[p].double() @ share0)) if share0 is not None else None,
            step_balancedness_mean=float(sb.mean()) if sb.numel() else None, top_expert=top,
        ))
    phase_tv = tv_distance(pc[0], pc[1]) if len(phases) == 2 else None
    # capacity
    capacity = []
    over = acc.overflow.cpu()
    any_over = acc.overflow_any.cpu()
    steps_over = acc.overflow_steps.cpu()
    for i, f in enumerate(options.capacity_factors):
        dropped = int(over[i].sum())
        capacity.append(CapacityLoad(
            factor=f, overflow=over[i].tolist(), dropped=dropped,
            dropped_fraction=dropped / assignments if assignments else None,
            experts_overflowing=int(any_over[i].sum()), steps_overflowing=int(steps_over[i]),
        ))
    bias = None
    if acc.bias and source.bias_effect and int(acc.wb_total.sum()) + int(acc.nb_total.sum()) > 0:
        wb, nb = acc.wb_total.cpu(), acc.nb_total.cpu()
        sbn = acc.step_bal_nb.cpu()[:, :acc.steps]
        q_with, q_without = Quantiles.of(sbn[0]), Quantiles.of(sbn[1])
        picks = int(wb.sum())
        bias = BiasEffect(
            counts_with=wb.tolist(), counts_without=nb.tolist(),
            load_with=load_stats(wb, top_n=options.top_n), load_without=load_stats(nb, top_n=options.top_n),
            balancedness_with=finite_or_none(balancedness(wb.double() @ share0)) if share0 is not None else None,
            balancedness_without=finite_or_none(balancedness(nb.double() @ share0)) if share0 is not None else None,
            step_balancedness_with=q_with.mean, step_balancedness_without=q_without.mean,
            changed_fraction=int(acc.changed) / picks if picks and acc.picks else None,
        )
    return LayerBalance(
        layer=layer, num_steps=acc.steps, tokens=acc.tokens if acc.tokens_known else None,
        assignments=assignments, uncounted=int(acc.uncounted), counts=total.tolist(),
        load=load_stats(total, top_n=options.top_n), ranks=ranks, windows=windows, phases=phases,
        phase_tv_distance=phase_tv, capacity=capacity, bias=bias,
    )


def _even_where_empty(load: torch.Tensor) -> torch.Tensor:
    """``[L, E]`` load for EPLB to fit, with a row of no traffic replaced by an even load: there is
    nothing to fit, and on all-zero loads every tie would go to the lowest expert (expert 0 took
    every redundant slot); an even load spreads the replicas over the experts in turn."""
    return torch.where(load.sum(-1, keepdim=True) > 0, load, torch.ones_like(load))


def _eplb_whatif(layers: list[int], results: list[LayerBalance], window_counts: dict[int, torch.Tensor],
                 options: BalanceOptions, E: int) -> EplbResult:
    eo = options.eplb
    gpus = eo.num_gpus or options.ep_sizes[0]
    redundant = eo.num_redundant if eo.num_redundant is not None else gpus
    weights = torch.tensor([r.counts for r in results], dtype=torch.float64)
    placement = rebalance_experts(_even_where_empty(weights), redundant, num_gpus=gpus, num_nodes=eo.num_nodes,
                                  num_groups=eo.num_groups, policy=eo.policy, layers=layers)
    before = contiguous_placement(layers, E, gpus)
    out = []
    for i, layer in enumerate(layers):
        counts = weights[i]
        mb, ma = before.share_matrix(layer), placement.share_matrix(layer)
        rb, ra = counts @ mb, counts @ ma
        wc = window_counts[layer].double()
        wb, wa = balancedness(wc @ mb), balancedness(wc @ ma)
        hb = ha = None
        if wc.shape[0] >= 2:
            half = wc.shape[0] // 2
            fit = rebalance_experts(_even_where_empty(wc[:half].sum(0, keepdim=True)), redundant, num_gpus=gpus, num_nodes=eo.num_nodes,
                                    num_groups=eo.num_groups, policy=eo.policy, layers=[layer])
            test = wc[half:].sum(0)
            hb = finite_or_none(balancedness(test @ mb))
            ha = finite_or_none(balancedness(test @ fit.share_matrix(layer)))
        out.append(EplbLayer(
            layer=layer, balancedness_before=finite_or_none(balancedness(rb)),
            balancedness_after=finite_or_none(balancedness(ra)),
            max_rank_load_before=float(rb.max()), max_rank_load_after=float(ra.max()),
            window_balancedness_before=finite_or_none(torch.nanmean(wb)) if wb.numel() else None,
            window_balancedness_after=finite_or_none(torch.nanmean(wa)) if wa.numel() else None,
            holdout_before=hb, holdout_after=ha, replicated=placement.replicated(layer),
            rank_load_before=rb.tolist(), rank_load_after=ra.tolist(),
        ))
    def over_layers(attr: str) -> Quantiles:
        return Quantiles.of(torch.tensor([v if (v := getattr(x, attr)) is not None else math.nan for x in out]))

    qb, qa = over_layers("balancedness_before"), over_layers("balancedness_after")
    hb, ha = over_layers("holdout_before"), over_layers("holdout_after")
    pays = None if hb.mean is None or ha.mean is None else bool(ha.mean > hb.mean)
    return EplbResult(num_redundant=redundant, num_gpus=gpus, num_nodes=eo.num_nodes, num_groups=eo.num_groups,
                      policy=placement.policy, layers=out, placement=placement, summary_before=qb, summary_after=qa,
                      holdout_before=hb, holdout_after=ha, pays_held_out=pays)


def default_ep_sizes(num_experts: int) -> list[int]:
    """The EP size used when none is given: the largest of 8, 4, 2, 1 that divides E."""
    for n in (8, 4, 2, 1):
        if num_experts % n == 0 and n <= num_experts:
            return [n]
    return [1]


def route_fn_from(fn, router, *, kernel: bool = False, name: str = "") -> Router:
    """The :class:`~routetool.engine.router.Router` of logits by ``fn`` (the seed's signature) with
    the trace's router parameters.

    ``kernel``: ``fn`` is a kernel under test (a variant or a ``--kernel module:function``): it runs
    once per captured step; otherwise ``fn`` is the PyTorch reference (whatever ``fn`` is given),
    run once per chunk of steps. Every call is judged by the one contract. ``name``: for reports
    (default ``kernel`` / ``reference``).
    """
    if kernel:
        return Router(router, fn, name or "kernel")
    return replace(Router.reference(router), name=name or "reference")


def _by_step(router: Router | None) -> bool:
    """Whether ``router`` runs once per captured step (a kernel under test, not the reference)."""
    return router is not None and not router.per_row
