"""Replay a trace, or every rank of a run folder, through a routing kernel and the reference, layer by layer.

The kernel runs once per captured step, on that step's rows; the reference, the comparison and
the counts run per chunk of consecutive steps (:mod:`routetool.engine.stream`). Per layer it
keeps only counters and a ``[E]`` histogram, so trace size is bounded by disk, not memory.

The unit of work is one rank's layer. A run folder (:mod:`routetool.io.run`) is replayed rank by
rank; a layer's results are the sums over the ranks that hold it (:func:`merge_layers`), and each
rank's own totals are kept (:class:`RankReplay`). Under torchrun the units are dealt out over
the processes and gathered (:mod:`routetool.engine.distributed`); the result is the same.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from routetool.engine.compare import (
    INVALID_REASONS,
    ComparisonSummary,
    WeightTolerance,
    boundary_margins,
    coarser_dtype,
    compare_step,
    invalid_reasons,
    weight_tolerance,
)
from routetool.engine.contract import RoutingFn
from routetool.engine.router import Router
from routetool.engine.stream import stream_layer
from routetool.engine.verdict import Verdict
from routetool.errors import RouteToolError
from routetool.engine.execution import Execution
from routetool.engine.load import LoadStats, expert_counts, load_stats
from routetool.numtext import list_items, parse_int
from routetool.engine.timing import Latency, cuda_graph_latency, synchronize
from routetool.engine.distributed import Workers
from routetool.io.run import RunInput
from routetool.io.trace import RouterConfig, Trace

DEFAULT_TIE_ULPS = 16.0
"""Near-tie tolerance of the comparison, in float32 ulps (see :mod:`routetool.engine.compare`)."""


MAX_RECORDED_INVALID_SHOWN = 5
"""Invalid recorded rows kept per ids-only layer, for the report (as :class:`ComparisonSummary` keeps failures)."""


@dataclass
class RecordedInvalidRow:
    """One invalid row of the recorded outputs of an ids-only layer: where, why, what it holds.

    Attributes:
        layer / step: where. row: the row's index in the layer (as :class:`RowFailure` counts).
        reasons: which of :data:`routetool.engine.compare.INVALID_REASONS` apply.
        topk_ids: the recorded ``[K]`` ids. topk_weights: the recorded ``[K]`` weights (float),
            or None when the trace records no weights.
        rank: the run folder's rank, None for one trace.
    """

    layer: int
    step: int
    row: int
    reasons: list[str]
    topk_ids: list[int]
    topk_weights: list[float] | None
    rank: int | None = None


@dataclass
class RoutedLayer:
    """The kernel's outputs of one layer of one rank's trace, as replay routed it.

    Attributes:
        rank_index: the rank's index in the run (:attr:`routetool.io.run.RunInput.ranks`; 0 for a trace).
        layer: the layer index.
        topk_ids: ``[T, K]`` int32 or int64, on the CPU, in the trace's row order (-1 on padded rows).
        topk_weights: ``[T, K]`` float32, on the CPU.
        is_padding: ``[T]`` bool, the trace's own, or None when it has none.
        step_offsets: the trace's captured steps, ``(0, ..., T)``.
    """

    rank_index: int
    layer: int
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    is_padding: torch.Tensor | None = None
    step_offsets: tuple[int, ...] = ()


@dataclass
class LayerReplay:
    """Replay results of one MoE layer.

    Attributes:
        layer: layer index. num_tokens / num_steps: rows and captured steps replayed (over the
            ranks that hold the layer, for a run folder).
        padded_rows: rows with ``is_padding``; padded_rows_ok: of those, rows the kernel
            set to exactly -1 / 0.0.
        nonfinite_rows: rows whose logits hold NaN or inf (of them, nonfinite_padded_rows
            are padded).
        min_margin / boundary_ties: smallest gap between the k-th and (k+1)-th biased
            score over unpadded rows, and rows where that gap is exactly 0 (None / 0 when
            topk == num_experts).
        kernel_vs_reference: the main comparison.
        reference_vs_recorded / kernel_vs_recorded: against the production outputs stored
            in the trace, when it has them.
        expert_counts: tokens per expert from the kernel's ids (padded rows excluded); for an
            ids-only layer, from the recorded ids of its valid rows (invalid ones left out).
        load: statistics of ``expert_counts``.
        ids_only: the layer has no logits (an imported routing dump): nothing was compared
            or timed, only the recorded ids' load counted.
        recorded_invalid / recorded_invalid_rows: ids-only layers: rows of the recorded
            outputs per invalid reason (:data:`routetool.engine.compare.INVALID_REASONS`: ids out of
            range or repeated, non-finite or negative weights), found without a reference, and
            the rows with any of them; None / 0 elsewhere. recorded_invalid_first: the first
            (up to :data:`MAX_RECORDED_INVALID_SHOWN`) of those rows.
        recorded_weight_factor: recorded against reference weights on rows of the same experts
            (:class:`WeightFactor`), when the trace records weights; else None.
    """

    layer: int
    num_tokens: int = 0
    num_steps: int = 0
    padded_rows: int = 0
    padded_rows_ok: int = 0
    nonfinite_rows: int = 0
    nonfinite_padded_rows: int = 0
    min_margin: float | None = None
    boundary_ties: int = 0
    kernel_vs_reference: ComparisonSummary = field(default_factory=ComparisonSummary)
    reference_vs_recorded: ComparisonSummary | None = None
    kernel_vs_recorded: ComparisonSummary | None = None
    expert_counts: list[int] = field(default_factory=list)
    load: LoadStats | None = None
    ids_only: bool = False
    recorded_invalid: dict[str, int] | None = None
    recorded_invalid_rows: int = 0
    recorded_invalid_first: list[RecordedInvalidRow] = field(default_factory=list)
    recorded_weight_factor: WeightFactor | None = None
    routed: RoutedLayer | None = field(default=None, repr=False, compare=False)  # (keep_routing, until gathered)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons().values()) and not self.recorded_invalid_rows

    def comparisons(self) -> dict[str, ComparisonSummary]:
        out = {"kernel_vs_reference": self.kernel_vs_reference}
        if self.reference_vs_recorded is not None:
            out["reference_vs_recorded"] = self.reference_vs_recorded
        if self.kernel_vs_recorded is not None:
            out["kernel_vs_recorded"] = self.kernel_vs_recorded
        return out


@dataclass
class WeightFactor:
    """How recorded weights relate to the reference's where both hold the same experts: the
    pattern of a routing with other semantics than the trace's router metadata (another
    ``route_scale``: one factor on every row; another renormalization: a factor per row).

    Attributes:
        rows: unpadded rows whose recorded ids are the reference's (in any order) and whose
            reference weights are all > 0 and recorded weights finite.
        one_factor_rows: of those, rows whose recorded weights are the reference's times one
            factor (within twice the recorded dtype's relative tolerance).
        factor_min / factor_max: the smallest and largest recorded / reference weight over the
            ``one_factor_rows`` (None without any).
        spread: the relative tolerance the factors were judged with.
    """

    rows: int = 0
    one_factor_rows: int = 0
    factor_min: float | None = None
    factor_max: float | None = None
    spread: float = 0.0

    def add(self, test_ids: torch.Tensor, test_w: torch.Tensor, exp_ids: torch.Tensor, exp_w: torch.Tensor,
            is_padding: torch.Tensor | None, spread: float) -> None:
        """Count one chunk: ``[n, K]`` recorded ids/weights against the reference's."""
        ti, order_t = torch.sort(test_ids.long(), dim=-1)
        ei, order_e = torch.sort(exp_ids.long(), dim=-1)
        tw, ew = test_w.float().gather(1, order_t), exp_w.float().gather(1, order_e)
        rows = (ti == ei).all(-1) & (ei >= 0).all(-1) & (ew > 0).all(-1) & torch.isfinite(tw).all(-1)
        if is_padding is not None:
            rows &= ~is_padding
        ratio = tw / torch.where(ew > 0, ew, 1.0)
        lo, hi = ratio.min(-1).values, ratio.max(-1).values
        one = rows & ((hi - lo) <= spread * hi.abs())
        self.spread = max(self.spread, spread)
        self.rows += int(rows.sum())
        n = int(one.sum())
        if n:
            self.one_factor_rows += n
            self._extend(float(lo[one].min()), float(hi[one].max()))

    def _extend(self, lo: float | None, hi: float | None) -> None:
        if lo is not None:
            self.factor_min = lo if self.factor_min is None else min(self.factor_min, lo)
        if hi is not None:
            self.factor_max = hi if self.factor_max is None else max(self.factor_max, hi)

    def merge(self, other: WeightFactor) -> None:
        self.rows += other.rows
        self.one_factor_rows += other.one_factor_rows
        self.spread = max(self.spread, other.spread)
        self._extend(other.factor_min, other.factor_max)

    def pattern(self, route_scale: float) -> str | None:
        """What the pattern suggests, or None when the rows show none (some row's weights are
        not one factor of the reference's, or every factor is 1)."""
        if not self.rows or self.one_factor_rows != self.rows or self.factor_min is None:
            return None
        lo, hi = self.factor_min, self.factor_max
        if abs(hi - 1.0) <= self.spread and abs(lo - 1.0) <= self.spread:
            return None
        if hi - lo <= self.spread * abs(hi):
            return (f"the recorded weights are the reference's times {lo:.4g} on every row, with the same ids: the "
                    "engine's routing may have other semantics than the trace's router metadata (a route_scale of "
                    f"{route_scale * lo:.4g}, not {route_scale:g}?)")
        return (f"each row's recorded weights are the reference's times a factor of its own ({lo:.3g} to {hi:.3g}), "
                "with the same ids: the engine's routing may have other semantics than the trace's router metadata "
                "(another renormalization, route_scale or eps?)")


@dataclass
class ShapeLatency:
    """Latency of one distinct step shape (``num_tokens`` rows), kernel and reference.

    Attributes:
        num_tokens: rows per call. steps: captured steps of this shape (all layers).
        layer / step: the step whose tensors were timed.
        kernel / reference: :class:`~routetool.engine.timing.Latency` in microseconds.
        speedup: reference p50 / kernel p50.
    """

    num_tokens: int
    steps: int
    layer: int
    step: int
    kernel: Latency
    reference: Latency

    @property
    def speedup(self) -> float:
        return self.reference.p50_us / self.kernel.p50_us if self.kernel.p50_us > 0 else float("nan")


@dataclass
class RankReplay:
    """One rank's share of the replay of a run folder.

    Attributes:
        rank: the global rank. trace: its trace's path. role: its place (``dp 1 tp 0``), or "".
        layers: its replayed layers. num_tokens / num_steps: its rows and steps (over them).
        kernel_vs_reference: its comparison, summed over its layers.
        ok: none of its layers has a finding.
    """

    rank: int
    trace: str
    role: str
    layers: list[int]
    num_tokens: int
    num_steps: int
    kernel_vs_reference: ComparisonSummary
    ok: bool

    @property
    def verdict(self) -> Verdict:
        """The rank's own: FAIL on a finding, NOTHING CHECKED when none of its rows was compared
        (ids-only, or no replayed layer), else PASS."""
        return Verdict.of(checked=self.kernel_vs_reference.rows, failed=not self.ok)


@dataclass
class ReplayResult:
    """Everything ``routetool replay`` found (rendered by :mod:`routetool.report.replay`).

    Attributes:
        trace: trace path. model / provenance: from the trace metadata. router: parameters.
        kernel: kernel name. execution: where it ran. tie_ulps: the near-tie tolerance.
        layers: per-layer results. total_counts: ``[E]`` tokens per expert over all layers.
        total_load: statistics of ``total_counts`` (experts summed over layers).
        latency: per distinct step shape, or None when not measured; latency_note says why.
        weights_semantics: of the recorded weights: ``renormalized`` (as the kernel) or
            ``unnormalized`` (raw top-k scores x route_scale; then kernel vs recorded compares
            ids only, and recorded vs reference compares against the raw scores).
        router_parameters: the trace's ``router_parameters`` metadata, set when only E and K
            of ``router`` are real (an imported ids-only trace: ``unknown (...)``; the other
            values are placeholders), else None.
        ranks: per rank, for a run folder (None for one trace).
        world_size: the processes the replay ran on (torchrun; 1 alone).
        notes: facts about the input (ranks missing from a run).
    """

    trace: str
    model: str
    provenance: str
    router: RouterConfig
    kernel: str
    execution: Execution
    tie_ulps: float
    layers: list[LayerReplay]
    total_counts: list[int]
    total_load: LoadStats
    latency: list[ShapeLatency] | None
    latency_note: str
    weights_semantics: str = "renormalized"
    router_parameters: str | None = None
    ranks: list[RankReplay] | None = None
    world_size: int = 1
    notes: list[str] = field(default_factory=list)
    partial: list = field(default_factory=list)
    """The traces read that hold less than a whole recording (:class:`routetool.io.run.PartialTrace`)."""
    routing: list[RoutedLayer] | None = field(default=None, repr=False)
    """The kernel's outputs of every layer with logits, when asked for (``keep_routing``); not in the JSON."""

    @property
    def ok(self) -> bool:
        return all(layer.ok for layer in self.layers)

    @property
    def verdict(self) -> Verdict:
        """FAIL on any finding; NOTHING CHECKED when no row was compared and no recorded output was
        invalid (an ids-only trace); else PASS. The exit code is ``verdict.exit_code``."""
        return Verdict.of(checked=self.compared_rows, failed=not self.ok)

    @property
    def compared_rows(self) -> int:
        """Rows the kernel and the reference were compared on (0 for an ids-only trace)."""
        return sum(layer.kernel_vs_reference.rows for layer in self.layers)

    @property
    def recorded_pattern(self) -> str | None:
        """When recorded vs reference fails on weights with the same ids in a pattern (one factor
        on every row, or one per row: :meth:`WeightFactor.pattern`), what it suggests; else None."""
        s = self.totals().get("reference_vs_recorded")
        if s is None or s.ok or s.mismatch or s.invalid:
            return None
        factor = WeightFactor()
        for layer in self.layers:
            if layer.recorded_weight_factor is not None:
                factor.merge(layer.recorded_weight_factor)
        return factor.pattern(self.router.route_scale)

    def totals(self) -> dict[str, ComparisonSummary]:
        """Comparison summaries summed over layers, by comparison name."""
        out: dict[str, ComparisonSummary] = {}
        for layer in self.layers:
            for name, summary in layer.comparisons().items():
                out.setdefault(name, ComparisonSummary()).merge(summary)
        return out


def parse_layers(spec: str | None, available: Sequence[int], path: object = None) -> list[int]:
    """Parse ``--layers`` (``"all"``, ``"3"``, ``"0,2,5-7"``) against the trace's layers.
    ``None`` means all layers; an empty spec (``""``) or an empty item (``"1,,2"``, ``"1,"``)
    or an item with spaces around it (``"0, 1"``) is refused, as every list option refuses
    them (:func:`routetool.numtext.list_items`).

    Raises:
        RouteToolError: malformed or empty spec, or a layer the trace does not hold.
    """
    if spec is None or spec.strip().lower() == "all":
        return list(available)
    if not spec.strip():
        raise RouteToolError(f"--layers {spec!r} is empty", fix="name layers, e.g. 0,2,5-7, or all")
    parts = list_items("--layers", spec, "0,2,5-7", noun="layers")

    def number(text: str) -> int:  # plain ASCII decimal: int() would read "1_0" or "1 " as 1
        value = parse_int(text)
        if value is None:
            raise ValueError(text)
        return value

    chosen: list[int] = []
    for part in parts:
        try:
            if "-" in part[1:]:
                lo, hi = part.split("-", 1) if not part.startswith("-") else (part, "")
                if number(hi) < number(lo):
                    raise RouteToolError(f"--layers {spec!r}: the range {part!r} is empty", fix="write low-high, e.g. 1-3")
                # only the trace's layers inside the range: a huge range never becomes a huge list
                lo_i, hi_i = number(lo), number(hi)
                inside = [layer for layer in available if lo_i <= layer <= hi_i]
                if len(inside) != hi_i - lo_i + 1:
                    absent = next(layer for layer in range(lo_i, hi_i + 1) if layer not in set(available))
                    raise RouteToolError(
                        f"--layers: the trace has no layer {absent} (in the range {part!r})", path=path,
                        fix=f"choose among {_layer_list(available)}")
                chosen.extend(inside)
            else:
                chosen.append(number(part))
        except RouteToolError:
            raise
        except ValueError:
            raise RouteToolError(f"--layers {spec!r}: cannot parse {part!r}", fix="use e.g. 0,2,5-7 or all") from None
    missing = sorted(set(chosen) - set(available))
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise RouteToolError(f"--layers: the trace has no layer {shown}", path=path,
                             fix=f"choose among {_layer_list(available)}")
    return sorted(set(chosen))


def _layer_list(available: Sequence[int]) -> str:
    return ", ".join(map(str, available[:20])) + (" ..." if len(available) > 20 else "")


def _nonfinite_rows(gating: torch.Tensor) -> torch.Tensor:
    return (~torch.isfinite(gating)).any(dim=-1)


def replay_trace(
    trace: Trace | RunInput,
    kernel_name: str,
    kernel_fn: RoutingFn,
    execution: Execution,
    *,
    layers: Sequence[int] | None = None,
    tie_ulps: float = DEFAULT_TIE_ULPS,
    measure_latency: bool = True,
    progress: Callable[[int], None] | None = None,
    budget_bytes: int | None = None,
    workers: Workers | None = None,
    keep_routing: bool = False,
) -> ReplayResult:
    """Replay ``trace`` (or every rank of a run) through ``kernel_fn`` and the reference; compare, count, time.

    Args:
        trace: an open trace, or a :class:`~routetool.io.run.RunInput` (a run folder's ranks).
        kernel_name / kernel_fn: the kernel under test.
        execution: from :func:`routetool.engine.execution.select_execution`.
        layers: layers to replay (default all; of a run, every layer any rank holds). Layers
            without gating_output (ids-only traces) are not compared or timed: only their
            recorded ids' load is counted.
        tie_ulps: near-tie tolerance of the comparison (float32 ulps).
        measure_latency: time each distinct step shape under CUDA graphs (GPU only).
        progress: called with the number of rows done after each chunk of steps (this
            process's share under torchrun).
        budget_bytes: bytes of logits per chunk and per piece of per-row work (:mod:`routetool.engine.stream`;
            default its ``DEFAULT_CHUNK_BYTES``).
        workers: the processes to share the units among (default: this one alone).
        keep_routing: keep the kernel's outputs of every layer with logits, on the CPU, in
            :attr:`ReplayResult.routing` (for :func:`write_routing`).

    Returns:
        A :class:`ReplayResult` (the same on every process).

    Raises:
        KernelRejection: the kernel rejecting the trace's inputs as its docstring documents (exit 2).
        KernelError: the kernel rejecting them without documenting it, crashing, writing into its
            inputs or returning outputs of the wrong shape, dtype or device (exit 1; see
            :mod:`routetool.engine.contract`).
    """
    run = trace if isinstance(trace, RunInput) else RunInput.of_trace(trace)
    workers = workers or Workers()
    router = run.meta.router
    E = router.num_experts
    device = execution.device
    chosen = list(run.layers) if layers is None else list(layers)
    semantics = run.meta.extra.get("weights_semantics", "renormalized")
    units = [(i, layer) for layer in chosen for i, r in enumerate(run.ranks) if layer in r.trace.layers]
    shapes: dict[int, list] = {}  # rows -> [steps, rank index, layer, step] of its first step
    for i, layer in units:
        info = run.ranks[i].trace.info(layer)
        if info.has_logits:
            for index, (a, b) in enumerate(zip(info.step_offsets, info.step_offsets[1:])):
                shapes.setdefault(b - a, [0, i, layer, index])[0] += 1

    def replay_unit(unit: tuple[int, int]) -> LayerReplay:
        i, layer = unit
        rank = run.ranks[i]
        info = rank.trace.info(layer)
        res = LayerReplay(layer=layer, num_tokens=info.num_tokens, num_steps=info.num_steps)
        if not info.has_logits:
            _ids_only_layer(rank.trace, res, E, device, progress, budget_bytes)
        else:
            kept: list[tuple] = []

            def keep(chunk, routed):
                pad = None if chunk.is_padding is None else chunk.is_padding.cpu()
                kept.append((routed.ids.cpu(), routed.weights.cpu(), pad))

            _replay_layer(rank.trace, res, kernel_name, kernel_fn, device, tie_ulps=tie_ulps,
                          unnormalized=semantics == "unnormalized", progress=progress, budget_bytes=budget_bytes,
                          on_routed=keep if keep_routing else None)
            if keep_routing:
                pads = [p for _, _, p in kept]
                res.routed = RoutedLayer(i, layer, torch.cat([ids for ids, _, _ in kept]),
                                         torch.cat([w for _, w, _ in kept]),
                                         None if any(p is None for p in pads) else torch.cat(pads),
                                         tuple(info.step_offsets))
        if rank.rank is not None:
            for failure in [f for c in res.comparisons().values() for f in c.failures] + res.recorded_invalid_first:
                failure.rank = rank.rank
        return res

    parts = workers.run(units, replay_unit)
    synchronize(device)
    routing = None
    if keep_routing:
        routing = [res.routed for res in parts if res.routed is not None]
        for res in parts:
            res.routed = None
    by_layer: dict[int, list[LayerReplay]] = {}
    for (_, layer), res in zip(units, parts):
        by_layer.setdefault(layer, []).append(res)
    results = [merge_layers(by_layer[layer]) for layer in chosen]
    total_counts = [sum(c) for c in zip(*(res.expert_counts for res in results))] if results else [0] * E

    latency = None
    if execution.interpreted and "Triton interpreter" in execution.device_name:
        note = "not measured: kernels run under the Triton interpreter on the CPU, whose timings say nothing about a GPU"
    elif execution.interpreted:
        note = "not measured: no GPU (timings on the CPU say nothing about a GPU)"
    elif not measure_latency:
        note = "not measured (--no-latency)"
    else:
        latency = workers.run(sorted(shapes), lambda n: _measure_shape(run, kernel_fn, router, device, n, shapes[n]))
        note = "CUDA-graph replay of each distinct step shape, on that step's own tensors (cache-warm)"
        if workers.world_size > 1:
            note += f"; the shapes shared among {workers.world_size} processes"
    ranks = None
    if run.is_run:
        ranks = []
        for i, r in enumerate(run.ranks):
            mine = [res for (j, _), res in zip(units, parts) if j == i]
            summary = ComparisonSummary()
            for res in mine:
                summary.merge(res.kernel_vs_reference)
            ranks.append(RankReplay(rank=r.rank, trace=str(r.trace.display_path), role=r.role,
                                    layers=[res.layer for res in mine], num_tokens=sum(res.num_tokens for res in mine),
                                    num_steps=sum(res.num_steps for res in mine), kernel_vs_reference=summary,
                                    ok=all(res.ok for res in mine)))
    return ReplayResult(
        trace=str(run.display_path),
        model=run.meta.model,
        provenance=run.meta.provenance,
        router=router,
        kernel=kernel_name,
        execution=execution,
        tie_ulps=tie_ulps,
        layers=results,
        total_counts=total_counts,
        total_load=load_stats(torch.tensor(total_counts, dtype=torch.int64)),
        latency=latency,
        latency_note=note,
        weights_semantics=semantics,
        router_parameters=run.meta.extra.get("router_parameters"),
        ranks=ranks,
        world_size=workers.world_size,
        notes=list(run.notes),
        partial=run.partial,
        routing=routing,
    )


ROUTING_FILE = "routing.safetensors"
"""The file name of each rank's routing in a run folder written by :func:`write_routing`."""


def write_routing(result: ReplayResult, path: str | Path, *, force: bool = False) -> list[Path]:
    """Write the kernel's outputs that replay kept (``keep_routing``) as ids-only traces
    (docs/trace-format.md): ``topk_ids``, ``topk_weights``, the input's ``is_padding`` and
    ``step_offsets`` per layer, the input's model and router spec, and in the metadata the kernel
    (``routed_by``) and the input (``source``). For a trace or an index, one trace at ``path``;
    for a run folder, a run folder at ``path`` (``rank-<r>/routing.safetensors``, each naming
    its rank), so that ``routetool diff`` can compare the routing of two kernels or machines.

    Returns:
        The files written.

    Raises:
        RouteToolError: nothing was routed (no layer with logits); ``path`` exists (a run
            folder's output is always a new folder; a file needs ``force``); the folder is not
            writable or the disk is full.
    """
    from routetool.io.paths import check_output_folder, path_kind
    from routetool.io.trace import LayerArrays, TraceMeta, write_trace

    path = Path(path)
    if not result.routing:
        raise RouteToolError("no layer with logits was replayed: there is no kernel routing to save", path=path,
                             fix="replay a trace with gating_output (an ids-only trace is already a routing)")
    by_rank: dict[int, dict[int, LayerArrays]] = {}
    for r in result.routing:
        by_rank.setdefault(r.rank_index, {})[r.layer] = LayerArrays(
            topk_ids=r.topk_ids, topk_weights=r.topk_weights, is_padding=r.is_padding,
            step_offsets=torch.tensor(r.step_offsets, dtype=torch.int64))
    extra = {"weights_semantics": "renormalized", "routed_by": result.kernel, "source": result.trace}
    provenance = (f"the routing of kernel {result.kernel} on {result.execution.device_name}, "
                  f"from routetool replay of {result.trace}")
    if result.ranks is None:
        meta = TraceMeta(model=result.model, router=result.router, provenance=provenance, extra=extra)
        return [write_trace(path, meta, by_rank[0], force=force)]
    if path_kind(path) != "missing":
        raise RouteToolError("already exists", path=path,
                             fix="name a new folder: the routing of a run folder is a run folder of its own")
    check_output_folder(path.parent)
    # built under a temporary name beside it and renamed when whole: an interrupted or failed write
    # leaves no half-written run folder
    building = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    try:
        for i, layers in sorted(by_rank.items()):
            rank = result.ranks[i].rank
            (building / f"rank-{rank}").mkdir()
            meta = TraceMeta(model=result.model, router=result.router, provenance=provenance,
                             extra={**extra, "rank": str(rank)})
            write_trace(building / f"rank-{rank}" / ROUTING_FILE, meta, layers)
        try:
            os.rename(building, path)  # (refused when path appeared meanwhile: never merged into another folder)
        except OSError as exc:
            raise RouteToolError(f"cannot be written ({exc.strerror or exc})", path=path,
                                 fix="name a new folder") from None
    finally:
        if building.exists():
            shutil.rmtree(building, ignore_errors=True)
    return [path / f"rank-{result.ranks[i].rank}" / ROUTING_FILE for i in sorted(by_rank)]


def merge_layers(parts: Sequence[LayerReplay]) -> LayerReplay:
    """One layer's results over the ranks that hold it: counts summed, comparisons merged
    (:meth:`ComparisonSummary.merge`, first failing rows in rank order), the smallest margin.
    One part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    out = LayerReplay(layer=parts[0].layer, ids_only=all(p.ids_only for p in parts))
    for name in ("num_tokens", "num_steps", "padded_rows", "padded_rows_ok", "nonfinite_rows", "nonfinite_padded_rows",
                 "boundary_ties", "recorded_invalid_rows"):
        setattr(out, name, sum(getattr(p, name) for p in parts))
    margins = [p.min_margin for p in parts if p.min_margin is not None]
    out.min_margin = min(margins) if margins else None
    for p in parts:
        out.kernel_vs_reference.merge(p.kernel_vs_reference)
        for name in ("reference_vs_recorded", "kernel_vs_recorded"):
            theirs = getattr(p, name)
            if theirs is not None:
                if getattr(out, name) is None:
                    setattr(out, name, ComparisonSummary())
                getattr(out, name).merge(theirs)
        if p.recorded_weight_factor is not None:
            if out.recorded_weight_factor is None:
                out.recorded_weight_factor = WeightFactor()
            out.recorded_weight_factor.merge(p.recorded_weight_factor)
        if p.recorded_invalid is not None:
            out.recorded_invalid = {k: (out.recorded_invalid or {}).get(k, 0) + v for k, v in p.recorded_invalid.items()}
        room = MAX_RECORDED_INVALID_SHOWN - len(out.recorded_invalid_first)
        out.recorded_invalid_first.extend(p.recorded_invalid_first[:max(0, room)])
    out.expert_counts = [sum(c) for c in zip(*(p.expert_counts for p in parts))]
    out.load = load_stats(torch.tensor(out.expert_counts, dtype=torch.int64))
    return out


def _replay_layer(trace: Trace, res: LayerReplay, kernel_name: str, kernel_fn: RoutingFn, device: torch.device, *,
                  tie_ulps: float, unnormalized: bool, progress: Callable[[int], None] | None,
                  budget_bytes: int | None, on_routed: Callable | None = None) -> LayerReplay:
    """One layer with logits: the kernel once per captured step, everything else per chunk of steps
    (``on_routed``: the router's capture hook, :class:`~routetool.engine.router.Router`)."""
    from routetool_kernels import reference

    layer = res.layer
    info = trace.info(layer)
    router = trace.meta.router
    E, K = router.num_experts, router.topk
    kernel_tol = weight_tolerance(torch.float32, router.route_scale)
    if info.has_recorded_ids:
        res.reference_vs_recorded = ComparisonSummary()
        res.kernel_vs_recorded = ComparisonSummary()
    z = dict(dtype=torch.int64, device=device)
    counts = torch.zeros(E, **z)
    padded, padded_ok, nonfinite, nonfinite_padded, ties = (torch.zeros((), **z) for _ in range(5))
    margin_min = None
    bias = trace.bias(layer).to(device)
    for piece, w, ids in _routed_pieces(trace, layer, device, Router(router, kernel_fn, kernel_name,
                                                                     on_routed=on_routed), bias, budget_bytes):
        chunk = piece  # (the per-row work runs over pieces of at most the budget)
        gating, pad = chunk.gating_output, chunk.is_padding
        ref_w, ref_ids, scores, biased = reference.route(gating, bias, router, is_padding=pad)
        where = dict(layer=layer, step=chunk.first_step, start=chunk.start, step_offsets=chunk.offsets)

        kernel_own = reference.pick_weights(scores, ids, router)
        cmp = compare_step(ids, w, ref_ids, ref_w, scores, biased, pad, tie_ulps=tie_ulps, tolerance=kernel_tol,
                           own_weights=kernel_own)
        res.kernel_vs_reference.add(cmp, test_ids=ids, test_weights=w, expected_ids=ref_ids, expected_weights=ref_w,
                                    tolerance=kernel_tol, **where)
        if chunk.recorded_ids is not None:
            rec_ids, rec_w = chunk.recorded_ids, chunk.recorded_weights
            rec_tol: WeightTolerance | None = None
            if rec_w is not None:
                rec_tol = weight_tolerance(coarser_dtype(rec_w.dtype, torch.float32), router.route_scale)
            # A tie-equivalent row's weights are checked against its own picks (pick_weights).
            recorded_own = reference.pick_weights(scores, rec_ids, router, renormalized=not unnormalized)
            pairs = [(res.reference_vs_recorded, rec_ids, rec_w, ref_ids, ref_w, recorded_own),
                     (res.kernel_vs_recorded, ids, w, rec_ids, rec_w, kernel_own)]
            if unnormalized:
                # Production kept the raw top-k scores (times route_scale): compare like with
                # like. The kernel always renormalises, so against it only ids are compared.
                raw = reference.pick_weights(scores, ref_ids, router, renormalized=False)
                if pad is not None:
                    raw = torch.where(pad[:, None], 0.0, raw)
                pairs = [(res.reference_vs_recorded, rec_ids, rec_w, ref_ids, raw, recorded_own),
                         (res.kernel_vs_recorded, ids, None, rec_ids, None, None)]
            if rec_w is not None:
                if res.recorded_weight_factor is None:
                    res.recorded_weight_factor = WeightFactor()
                res.recorded_weight_factor.add(rec_ids, rec_w, ref_ids, pairs[0][4], pad, 2 * rec_tol.rtol)
            for summary, test_ids, test_w, exp_ids, exp_w, own in pairs:
                c = compare_step(test_ids, test_w, exp_ids, exp_w, scores, biased, pad,
                                 tie_ulps=tie_ulps, tolerance=rec_tol, own_weights=own)
                summary.add(c, test_ids=test_ids, test_weights=test_w, expected_ids=exp_ids, expected_weights=exp_w,
                            tolerance=rec_tol, **where)

        bad_rows = _nonfinite_rows(gating)
        nonfinite += bad_rows.sum()
        if pad is not None:
            padded += pad.sum()
            padded_ok += (pad & (ids == -1).all(-1) & (w == 0).all(-1)).sum()
            nonfinite_padded += (bad_rows & pad).sum()
        margins = boundary_margins(biased, K, pad)
        if margins.numel():
            m = float(margins.min())
            margin_min = m if margin_min is None else min(margin_min, m)
            ties += (margins == 0).sum()
        counts += expert_counts(ids, E) if pad is None else expert_counts(ids[~pad], E)
        if progress is not None:
            progress(chunk.rows)
    res.padded_rows, res.padded_rows_ok = int(padded), int(padded_ok)
    res.nonfinite_rows, res.nonfinite_padded_rows, res.boundary_ties = int(nonfinite), int(nonfinite_padded), int(ties)
    res.min_margin = margin_min
    res.expert_counts = counts.tolist()
    res.load = load_stats(counts)
    return res


def _routed_pieces(trace: Trace, layer: int, device: torch.device, router: Router, bias: torch.Tensor,
                   budget_bytes: int | None):
    """``(piece, weights, ids)`` over ``layer``: the kernel routes each captured step whole (chunks
    of whole steps, :meth:`~routetool.engine.router.Router.route`), the rest of the work gets its
    outputs over pieces of at most ``budget_bytes`` (:meth:`~routetool.engine.stream.Chunk.pieces`).

    Raises:
        KernelRejection / KernelError: the kernel broke the contract, named by layer and step.
        RouteToolError: a step larger than :data:`~routetool.engine.stream.KERNEL_STEP_BYTES`.
    """
    for chunk in stream_layer(trace, layer, device, budget_bytes=budget_bytes, whole_steps=True):
        routed = router.route(chunk, bias)
        if not routed.ok:
            raise router.error(routed.outcome, f"layer {layer} step {routed.step}", path=trace.display_path,
                               layer=layer, name=f"kernel {router.name!r}")
        for piece in chunk.pieces(budget_bytes):
            yield piece, chunk.rows_of(piece, routed.weights), chunk.rows_of(piece, routed.ids)


def _ids_only_layer(trace: Trace, res: LayerReplay, E: int, device: torch.device,
                    progress: Callable[[int], None] | None, budget_bytes: int | None) -> LayerReplay:
    """A layer without logits: only the load of the recorded ids (valid, unpadded rows), nothing to compare or time."""
    res.ids_only = True
    counts = torch.zeros(E, dtype=torch.int64, device=device)
    invalid = torch.zeros(len(INVALID_REASONS), dtype=torch.int64, device=device)
    padded = torch.zeros((), dtype=torch.int64, device=device)
    for chunk in stream_layer(trace, res.layer, device, budget_bytes=budget_bytes):
        ids, weights, pad = chunk.recorded_ids, chunk.recorded_weights, chunk.is_padding
        reasons = invalid_reasons(ids, weights, pad, E)
        invalid += reasons.sum(0)
        bad = reasons.any(-1)
        room = MAX_RECORDED_INVALID_SHOWN - len(res.recorded_invalid_first)
        if room > 0:
            for r in torch.nonzero(bad).flatten()[:room].tolist():
                res.recorded_invalid_first.append(RecordedInvalidRow(
                    layer=res.layer, step=chunk.step_of(r), row=chunk.start + r,
                    reasons=[name for name, on in zip(INVALID_REASONS, reasons[r].tolist()) if on],
                    topk_ids=[int(v) for v in ids[r].tolist()],
                    topk_weights=None if weights is None else [float(v) for v in weights[r].float().tolist()],
                ))
        res.recorded_invalid_rows += int(bad.sum())
        keep = ~bad  # an invalid row's ids say nothing about the load (a repeated id would count twice)
        if pad is not None:
            padded += pad.sum()
            keep &= ~pad
        counts += expert_counts(ids[keep], E)
        if progress is not None:
            progress(chunk.rows)
    res.padded_rows = int(padded)
    res.expert_counts = counts.tolist()
    res.load = load_stats(counts)
    res.recorded_invalid = dict(zip(INVALID_REASONS, invalid.tolist()))
    return res


def _measure_shape(run: RunInput, kernel_fn: RoutingFn, router: RouterConfig, device: torch.device, n: int,
                   where: list) -> ShapeLatency:
    """Kernel and reference latency of the step shape of ``n`` rows, on its first step's tensors."""
    from routetool_kernels.reference import musespark1x_routing_reference

    count, i, layer, index = where
    trace = run.ranks[i].trace
    offsets = trace.info(layer).step_offsets
    step = trace.read_rows(layer, offsets[index], offsets[index + 1])
    gating = step.gating_output.to(device)
    bias = trace.bias(layer).to(device)
    pad = step.is_padding.to(device) if step.is_padding is not None else None
    w = torch.empty((n, router.topk), dtype=torch.float32, device=device)
    ids = torch.empty((n, router.topk), dtype=torch.int32, device=device)
    kwargs = router.kernel_kwargs()

    def run_kernel():
        kernel_fn(gating, bias, topk_weights=w, topk_ids=ids, is_padding=pad, **kwargs)

    def run_reference():
        musespark1x_routing_reference(gating, bias, is_padding=pad, **kwargs)

    return ShapeLatency(num_tokens=n, steps=count, layer=layer, step=index,
                        kernel=cuda_graph_latency(run_kernel), reference=cuda_graph_latency(run_reference))
