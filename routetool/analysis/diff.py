"""``routetool diff A B``: where and why two routings of the same tokens differ.

Two sources hold the same tokens (traces, run folders, ids-only traces, the engines' routing
outputs); each gives, per layer, the routing of every token row: its recorded ``topk_ids`` /
``topk_weights`` where it holds them, else its logits routed by the reference (or a kernel
under test) with its own router spec. The sources are aligned layer by layer (and rank by rank
for run folders), by step and row: the same layers, the same number of tokens in every step
(``align="rows"``: the same number of tokens in the layer), and where both sources carry them
(engine dumps), the same request per step and the same token position per row. Both are streamed, chunk by chunk,
and every aligned piece of rows is measured at once, on the device:

* each token row (a *token-layer*) falls in one class: ``same`` (same ids in the same slots,
  weights equal within ``weight_ulps``), ``weights`` (same ids and slots, a weight further apart),
  ``order`` (the same set of experts in other slots: a slot-order flip), ``tie`` (another set,
  every expert that differs inside a near-tie at the k-th pick), ``real`` (another set, outside
  a near-tie, or a row padded on one side only); rows padded on both sides are not compared;
* a near-tie is judged by the biased selection keys of each side that holds logits: by the keys
  of one side at least, each expert picked by one side only has a key within ``tie_ulps``
  float32 ulps of that side's k-th largest key (:func:`routetool.engine.compare.float32_ulp`; 0 = exact ties). Without logits on
  either side no difference can be judged a tie (``ties_judged`` False);
* overlap@k: ``|A ∩ B| / k`` averaged over the rows; weight deltas: matched by expert id on rows
  holding the same set, ``|wA - wB|`` (max, mean) and in float32 ulps of the larger weight;
* per token (rows at one position of every layer of a rank, where the layers hold the same
  steps): whether it differs in at least one layer, and the first layer where it does.

The verdict: ``identical`` when no compared row differs, else ``different``; differences
are tolerated (exit 0) when, after leaving out ties (``ignore_ties``) and slot-order flips
(``ignore_order``), none is left or their share of the compared rows is at most
``max_flip_rate``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from routetool.engine.compare import float32_ulp
from routetool.errors import EXIT_FINDINGS, EXIT_OK, RouteToolError

PIECE_ROWS = 1 << 16
"""Rows measured at once (bounds the ``[rows, K, K]`` id comparison)."""

MAX_EXAMPLES = 8
"""First differing rows kept for the report."""

CLASSES = ("same", "weights", "order", "tie", "real")


# ---------------------------------------------------------------------------------------
# sources
@dataclass
class Rows:
    """Aligned rows of one side: ``ids`` ``[n, K]`` int64 (-1 padded), ``weights`` ``[n, K]``
    float32 or None, ``biased`` ``[n, E]`` float32 selection keys or None (no logits),
    ``padded`` ``[n]`` bool."""

    ids: torch.Tensor
    weights: torch.Tensor | None
    biased: torch.Tensor | None
    padded: torch.Tensor

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def cut(self, a: int, b: int) -> Rows:
        return Rows(self.ids[a:b], None if self.weights is None else self.weights[a:b],
                    None if self.biased is None else self.biased[a:b], self.padded[a:b])


def _route_logits(router, spec, gating: torch.Tensor, bias: torch.Tensor, pad: torch.Tensor | None, chunk,
                  path: str, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weights, ids, biased)`` of logits: the reference, or ``router`` (a kernel) with the
    reference's keys for judging ties."""
    from routetool_kernels import reference

    try:
        weights, ids, _, biased = reference.route(gating, bias, spec, is_padding=pad)
    except (ValueError, NotImplementedError) as exc:
        raise RouteToolError(f"cannot route its logits ({exc})", path=path, tensor=f"layers.{layer}.gating_output",
                             fix="check the router in its metadata") from None
    if router is not None:
        routed = router.route_or_raise(chunk, bias, path)
        weights, ids = routed.weights.float(), routed.ids
    return weights, ids, biased


class Source:
    """One side of a diff (a trace, sharded trace, run folder, or an engine's routing dump).

    Attributes:
        path: as given. label: ``A`` or ``B``. kind: ``trace`` or the dump's format.
        num_experts / topk: E and K. spec: the router spec (None for a dump without one).
        units: ``(rank, layer)`` pairs it holds (rank None for a single trace or a dump).
    """

    def __init__(self, path: Path, label: str):
        from routetool.io.inputs import detect_format

        self.path, self.label = Path(path), label
        self.kind = detect_format(self.path)
        self._input = self._imported = None
        if self.kind == "trace":
            from routetool.io.inputs import open_input

            self._input = open_input(self.path)
            self.spec = self._input.meta.router
            self.num_experts, self.topk = self.spec.num_experts, self.spec.topk
            self._traces = {r.rank: r.trace for r in self._input.ranks}
            self.units = [(r.rank, layer) for r in self._input.ranks for layer in r.trace.layers]
        else:
            from routetool.io.dumps import ImportOptions, read_dump

            self._imported = read_dump(self.path, ImportOptions(
                refuse_counts=f"diff compares per-token routing; analyse its load with `routetool balance {self.path}`"))
            self.spec = self._imported.router
            self.num_experts, self.topk = self._imported.num_experts, self._imported.topk
            self.units = [(None, layer) for layer in sorted(self._imported.layers)]

    @property
    def ranks(self) -> list:
        return sorted({r for r, _ in self.units}, key=lambda r: -1 if r is None else r)

    def layers(self, rank) -> list[int]:
        return sorted(layer for r, layer in self.units if r == rank)

    def step_offsets(self, rank, layer: int) -> list[int]:
        if self._input is not None:
            return list(self._traces[rank].info(layer).step_offsets)
        return list(self._imported.layers[layer].step_offsets)

    def holds(self, rank, layer: int) -> str:
        """What the routing comes from: ``recorded`` ids or ``logits``."""
        if self._input is not None:
            info = self._traces[rank].info(layer)
            return "recorded" if info.has_recorded_ids else "logits"
        return "recorded" if self._imported.layers[layer].topk_ids is not None else "logits"

    def partial(self) -> list:
        """The traces of this source that hold less than a whole recording
        (:meth:`routetool.io.run.RunInput.partial`); empty for a dump."""
        return [] if self._input is None else list(self._input.partial)

    def step_labels(self) -> list[str] | None:
        """Each step's name (a dump's request ids), or None."""
        return None if self._imported is None else self._imported.step_labels

    def positions(self, layer: int):
        """``[T]`` token positions in their requests (a dump that records them), or None."""
        return None if self._imported is None else self._imported.layers[layer].positions

    def has_logits(self, rank, layer: int) -> bool:
        if self._input is not None:
            return self._traces[rank].info(layer).has_logits
        return self._imported.layers[layer].gating_output is not None

    def rows(self, rank, layer: int, device: torch.device, kernel=None) -> Iterator[Rows]:
        """The layer's rows in order, in chunks (a trace streamed from disk by the engine);
        ``kernel``: ``(name, fn)`` routing logits with this source's spec (None: the reference)."""
        router = None
        if kernel is not None and self.spec is not None:
            from routetool.engine.router import Router

            router = Router(self.spec, kernel[1], kernel[0])
        if self._input is not None:
            yield from self._trace_rows(self._traces[rank], layer, device, router)
        else:
            yield from self._dump_rows(layer, device, router)

    def _trace_rows(self, trace, layer: int, device: torch.device, router) -> Iterator[Rows]:
        from routetool.engine.stream import stream_layer

        path = str(trace.display_path)
        recorded = trace.info(layer).has_recorded_ids
        bias = trace.bias(layer).to(device)
        for chunk in stream_layer(trace, layer, device, whole_steps=router is not None and not recorded):
            pad = chunk.is_padding
            biased = None
            if recorded:
                ids = chunk.recorded_ids.long()
                weights = None if chunk.recorded_weights is None else chunk.recorded_weights.float()
                if chunk.gating_output is not None:
                    _, _, biased = _route_logits(None, self.spec, chunk.gating_output, bias, pad, chunk, path, layer)
            else:
                weights, ids, biased = _route_logits(router, self.spec, chunk.gating_output, bias, pad, chunk,
                                                     path, layer)
                ids = ids.long()
            padded = (ids < 0).all(-1) if pad is None else pad.to(device) | (ids < 0).all(-1)
            yield Rows(ids, weights, biased, padded)

    def _dump_rows(self, layer: int, device: torch.device, router) -> Iterator[Rows]:
        x = self._imported.layers[layer]
        n = x.num_tokens
        for a in range(0, max(n, 1), PIECE_ROWS):
            b = min(n, a + PIECE_ROWS)
            if b <= a:
                return
            biased = weights = None
            if x.topk_ids is not None:
                ids = x.topk_ids[a:b].to(device).long()
                weights = None if x.topk_weights is None else x.topk_weights[a:b].to(device).float()
            if x.gating_output is not None:
                if self.spec is None:
                    raise RouteToolError("holds logits but names no router to route them", path=self.path,
                                         fix="import it with its router: `routetool import`")
                bias = (x.bias if x.bias is not None else torch.zeros(self.num_experts)).float().to(device)
                w, i, biased = _route_logits(None, self.spec, x.gating_output[a:b].to(device), bias, None, None,
                                             str(self.path), layer)
                if x.topk_ids is None:
                    ids, weights = i.long(), w
            yield Rows(ids, weights, biased, (ids < 0).all(-1))

    def close(self) -> None:
        if self._input is not None:
            self._input.close()


def _aligned(a: Iterator[Rows], b: Iterator[Rows], piece_rows: int = PIECE_ROWS) -> Iterator[tuple[Rows, Rows]]:
    """Pieces of equal length from two row streams whose chunks may be cut differently."""
    ra = rb = None
    ia = ib = 0
    while True:
        if ra is None or ia >= len(ra):
            ra, ia = next(a, None), 0
        if rb is None or ib >= len(rb):
            rb, ib = next(b, None), 0
        if ra is None or rb is None:
            return
        n = min(len(ra) - ia, len(rb) - ib, piece_rows)
        if n == 0:
            continue
        yield ra.cut(ia, ia + n), rb.cut(ib, ib + n)
        ia += n
        ib += n


# ---------------------------------------------------------------------------------------
# measures
@dataclass
class LayerDiff:
    """The measures of one layer (summed over ranks).

    Attributes:
        layer: the layer. rows: token-layers compared (unpadded on one side at least).
        padded: rows padded on both sides (not compared).
        classes: rows per class (:data:`CLASSES`). same_set: rows with the same set of experts.
        overlap_sum: sum over rows of ``|A ∩ B|`` (overlap@k = overlap_sum / (rows * K)).
        weight_rows: rows whose weights were compared (same set, both sides with weights).
        weight_max / weight_sum / weight_count: max and sum of ``|ΔW|`` over the compared weights.
        weight_max_ulps: the largest ``|ΔW|`` in float32 ulps of the larger weight.
        first_divergence: tokens whose first differing layer is this one.
    """

    layer: int
    rows: int = 0
    padded: int = 0
    classes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    same_set: int = 0
    overlap_sum: int = 0
    weight_rows: int = 0
    weight_max: float = 0.0
    weight_sum: float = 0.0
    weight_count: int = 0
    weight_max_ulps: float = 0.0
    first_divergence: int = 0

    @property
    def differing(self) -> int:
        return self.rows - self.classes["same"]

    @property
    def agreement(self) -> float | None:
        """Share of compared rows in class ``same``."""
        return self.classes["same"] / self.rows if self.rows else None

    @property
    def set_agreement(self) -> float | None:
        """Share of compared rows with the same set of experts."""
        return self.same_set / self.rows if self.rows else None

    def overlap(self, topk: int) -> float | None:
        return self.overlap_sum / (self.rows * topk) if self.rows else None

    @property
    def weight_mean(self) -> float | None:
        return self.weight_sum / self.weight_count if self.weight_count else None


@dataclass
class DiffExample:
    """One differing row: where, its class, both sides' ids and weights."""

    rank: int | None
    layer: int
    step: int
    row: int
    cls: str
    ids_a: list[int]
    ids_b: list[int]
    weights_a: list[float] | None
    weights_b: list[float] | None


@dataclass
class DiffResult:
    """What :func:`diff_sources` found; carries its verdict and exit code."""

    source_a: str
    source_b: str
    holds_a: str
    holds_b: str
    num_experts: int
    topk: int
    align: str
    kernel: str | None
    tie_ulps: float
    weight_ulps: float
    ignore_ties: bool
    ignore_order: bool
    max_flip_rate: float | None
    layers: list[LayerDiff]
    ties_judged: bool
    weights_compared: bool
    tokens: int | None
    tokens_differing: int | None
    examples: list[DiffExample]
    notes: list[str] = field(default_factory=list)
    partial: list = field(default_factory=list)

    def total(self, name: str) -> int:
        return sum(getattr(x, name) for x in self.layers)

    def count(self, cls: str) -> int:
        return sum(x.classes[cls] for x in self.layers)

    @property
    def rows(self) -> int:
        return self.total("rows")

    @property
    def differing(self) -> int:
        return self.rows - self.count("same")

    @property
    def outside_ties(self) -> int:
        """Rows whose set of experts differs outside a near-tie (real disagreements)."""
        return self.count("real")

    @property
    def counted(self) -> int:
        """Differing rows left once tolerated classes are left out."""
        n = self.differing
        if self.ignore_ties:
            n -= self.count("tie")
        if self.ignore_order:
            n -= self.count("order")
        return n

    @property
    def identical(self) -> bool:
        return self.differing == 0

    @property
    def tolerated(self) -> bool:
        """Different, but within the thresholds."""
        if self.identical:
            return False
        if self.counted == 0:
            return True
        return self.max_flip_rate is not None and self.counted <= self.max_flip_rate * self.rows

    @property
    def verdict(self) -> str:
        return "identical" if self.identical else "different"

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.identical or self.tolerated else EXIT_FINDINGS

    def worst_layers(self, n: int = 3) -> list[LayerDiff]:
        bad = [x for x in self.layers if x.differing]
        return sorted(bad, key=lambda x: (-(x.differing / x.rows), x.layer))[:n]


def _sorted_by_id(ids: torch.Tensor, weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    s, order = ids.sort(-1)
    return s, None if weights is None else weights.gather(-1, order)


def _near_tie(biased: torch.Tensor, ids_a: torch.Tensor, ids_b: torch.Tensor, in_b: torch.Tensor,
              in_a: torch.Tensor, topk: int, tie_ulps: float) -> torch.Tensor:
    """``[n]`` bool: every expert picked by one side only has a key within ``tie_ulps`` float32
    ulps of the k-th largest key (``biased`` ``[n, E]``)."""
    kth = torch.topk(biased, topk, dim=-1).values[:, topk - 1:topk]  # [n, 1]
    tol = tie_ulps * float32_ulp(kth)

    def near(ids: torch.Tensor, other_has: torch.Tensor) -> torch.Tensor:
        keys = biased.gather(-1, ids.clamp_min(0))
        ok = (keys - kth).abs() <= tol
        return (ok | other_has).all(-1)

    return near(ids_a, in_b) & near(ids_b, in_a)


@dataclass
class _Piece:
    cls: torch.Tensor  # [n] int8 index into CLASSES, -1 = padded on both sides
    same_set: torch.Tensor
    overlap: torch.Tensor
    dw: torch.Tensor | None  # [n, K] |ΔW| on rows with the same set, else 0
    dw_ulps: torch.Tensor | None
    wrows: torch.Tensor | None


def measure(a: Rows, b: Rows, topk: int, *, tie_ulps: float, weight_ulps: float) -> _Piece:
    """Classify aligned rows (see the module docstring).

    Args:
        a / b: rows of the two sides, the same ``n``. topk: K. tie_ulps: near-tie tolerance in
            float32 ulps. weight_ulps: weights this many ulps apart still count as equal.

    Returns:
        the per-row class (``[n]`` int8 index into :data:`CLASSES`, -1 padded on both sides),
        same-set flags, ``|A ∩ B|`` per row, and the weight deltas ``[n, K]``.
    """
    ia, ib = a.ids, b.ids
    both_pad = a.padded & b.padded
    one_pad = a.padded ^ b.padded
    in_b = (ia[:, :, None] == ib[:, None, :]).any(-1) & (ia >= 0)  # [n, K]: A's pick is among B's
    in_a = (ib[:, :, None] == ia[:, None, :]).any(-1) & (ib >= 0)
    overlap = in_b.sum(-1)
    same_set = (in_b.all(-1) & in_a.all(-1)) & ~one_pad
    same_order = (ia == ib).all(-1) & ~one_pad
    dw = dw_ulps = wrows = None
    weights_differ = torch.zeros_like(same_order)
    if a.weights is not None and b.weights is not None:
        _, wa = _sorted_by_id(ia, a.weights)
        _, wb = _sorted_by_id(ib, b.weights)
        wrows = same_set & ~both_pad
        dw = torch.where(wrows[:, None], (wa - wb).abs(), torch.zeros_like(wa))
        dw = torch.nan_to_num(dw, nan=float("inf"))
        dw_ulps = dw / float32_ulp(torch.maximum(wa.abs(), wb.abs()))
        weights_differ = (dw_ulps > weight_ulps).any(-1) & wrows
    tie = torch.zeros_like(same_order)
    judged = [x.biased for x in (a, b) if x.biased is not None]
    other = (~same_set & ~one_pad & ~both_pad).nonzero().flatten()  # judged on these rows only
    if judged and other.numel():
        near = torch.zeros(other.shape, dtype=torch.bool, device=ia.device)
        for biased in judged:  # inside a near-tie of either routing
            near |= _near_tie(biased[other], ia[other], ib[other], in_b[other], in_a[other], topk, tie_ulps)
        tie[other] = near
    cls = torch.full(ia.shape[:1], 4, dtype=torch.int8, device=ia.device)  # real
    cls = torch.where(tie, 3, cls)
    cls = torch.where(same_set, 2, cls)
    cls = torch.where(same_order, torch.where(weights_differ, 1, 0), cls).to(torch.int8)
    cls = torch.where(both_pad, -1, cls).to(torch.int8)
    return _Piece(cls, same_set & ~both_pad, overlap, dw, dw_ulps, wrows)


def check_aligned(a: Source, b: Source, layers: list[int] | None, align: str) -> list[tuple]:
    """The ``(rank, layer)`` units both sources hold, checked to hold the same tokens.

    Raises:
        RouteToolError: other experts or top-k, other ranks, other layers, other tokens per step
            (``align="steps"``) or per layer (``align="rows"``), or ``layers`` not held by both.
    """
    shown = f"{a.path} and {b.path}"
    fix = "diff two routings of the same tokens"
    if a.topk != b.topk:
        raise RouteToolError(f"cannot be aligned: A routes top-{a.topk}, B top-{b.topk}", path=shown, fix=fix)
    if a.num_experts != b.num_experts and a.spec is not None and b.spec is not None:
        raise RouteToolError(f"cannot be aligned: A routes over {a.num_experts} experts, B over {b.num_experts}",
                             path=shown, fix=fix)
    if a.ranks != b.ranks:
        def names(s):
            return "one trace" if s.ranks == [None] else "ranks " + ",".join(map(str, s.ranks))
        raise RouteToolError(f"cannot be aligned: A holds {names(a)}, B {names(b)}", path=shown,
                             fix="diff rank folders one by one, or two run folders of the same ranks")
    units = []
    for rank in a.ranks:
        la, lb = a.layers(rank), b.layers(rank)
        want = layers
        if want is None:
            if la != lb:
                raise RouteToolError(f"cannot be aligned: different layers (A holds {_span(la)}, B holds "
                                     f"{_span(lb)})", path=shown,
                                     fix=f"choose the layers both hold with --layers {_span(sorted(set(la) & set(lb)))}"
                                     if set(la) & set(lb) else fix)
            want = la
        for layer in want:
            for s, held in ((a, la), (b, lb)):
                if layer not in held:
                    raise RouteToolError(f"cannot be aligned: {s.label} holds no layer {layer}", path=s.path,
                                         fix=f"choose among {_span(held)}")
            oa, ob = a.step_offsets(rank, layer), b.step_offsets(rank, layer)
            where = f"layer {layer}" + ("" if rank is None else f" of rank {rank}")
            if oa[-1] != ob[-1]:
                raise RouteToolError(f"cannot be aligned: different token counts: {where} holds {oa[-1]:,} tokens in "
                                     f"A, {ob[-1]:,} in B", path=shown, fix=fix)
            if align == "steps" and oa != ob:
                sa, sb = _sizes(oa), _sizes(ob)
                i = next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), min(len(sa), len(sb)))
                what = (f"step {i} holds {sa[i]:,} tokens in A, {sb[i]:,} in B" if i < min(len(sa), len(sb))
                        else f"A holds {len(sa)} steps, B {len(sb)}")
                raise RouteToolError(f"cannot be aligned: different token counts per step: {where}: {what}",
                                     path=shown, fix="diff the same steps, or align by row alone with --align rows")
            pa, pb = a.positions(layer), b.positions(layer)
            if pa is not None and pb is not None and not torch.equal(pa, pb):
                row = int((pa != pb).nonzero()[0]) if pa.shape == pb.shape else 0
                raise RouteToolError(f"cannot be aligned: {where}: row {row} is token position {int(pa[row])} in A, "
                                     f"{int(pb[row])} in B", path=shown, fix=fix)
            units.append((rank, layer))
    la, lb = a.step_labels(), b.step_labels()
    if align == "steps" and la is not None and lb is not None and la != lb:
        i = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), 0)
        raise RouteToolError(f"cannot be aligned: step {i} is request {la[i]!r} in A, {lb[i]!r} in B", path=shown,
                             fix="diff the same requests in the same order")
    return units


def _sizes(offsets: list[int]) -> list[int]:
    return [y - x for x, y in zip(offsets, offsets[1:])]


def _span(layers: list[int]) -> str:
    return ",".join(map(str, layers)) if layers else "none"


def diff_sources(a: Source, b: Source, *, layers: list[int] | None = None, align: str = "steps",
                 tie_ulps: float = 16.0, weight_ulps: float = 0.0, ignore_ties: bool = False,
                 ignore_order: bool = False, max_flip_rate: float | None = None,
                 device: torch.device | None = None, kernel=None, progress=None) -> DiffResult:
    """Diff the routing of two aligned sources (see the module docstring).

    Args:
        a / b: the sources. layers: the layers to compare (default: all, which must agree).
        align: ``steps`` (same tokens per step) or ``rows`` (same tokens per layer).
        tie_ulps / weight_ulps: tolerances in float32 ulps. ignore_ties / ignore_order /
            max_flip_rate: the thresholds of the verdict. device: where to measure (CPU).
        kernel: ``(name, fn)``, the kernel under test that routes logits-only sides, each with its
            own router spec (None: the reference). progress: called with the rows of each aligned piece.

    Raises:
        RouteToolError: the sources cannot be aligned (:func:`check_aligned`) or read.
    """
    device = device or torch.device("cpu")
    units = check_aligned(a, b, layers, align)
    K = a.topk
    per_layer: dict[int, LayerDiff] = {}
    examples: list[DiffExample] = []
    ties_judged = weights_compared = False
    tokens = tokens_differing = 0
    token_measures = True
    for rank in a.ranks:
        rank_units = [layer for r, layer in units if r == rank]
        offsets = {layer: a.step_offsets(rank, layer) for layer in rank_units}
        same_tokens = len({tuple(o) for o in offsets.values()}) <= 1
        token_measures &= same_tokens
        n_tok = offsets[rank_units[0]][-1] if rank_units else 0
        first = torch.full((n_tok,), -1, dtype=torch.int32) if same_tokens else None
        seen = torch.zeros(n_tok, dtype=torch.bool) if same_tokens else None
        for layer in rank_units:
            ld = per_layer.setdefault(layer, LayerDiff(layer))
            ties_judged |= a.has_logits(rank, layer) or b.has_logits(rank, layer)
            start = 0
            for ra, rb in _aligned(a.rows(rank, layer, device, kernel), b.rows(rank, layer, device, kernel)):
                n = len(ra)
                p = measure(ra, rb, K, tie_ulps=tie_ulps, weight_ulps=weight_ulps)
                compared = p.cls >= 0
                counts = torch.bincount(p.cls[compared].long(), minlength=len(CLASSES)).tolist()
                for name, c in zip(CLASSES, counts):
                    ld.classes[name] += c
                ld.rows += int(compared.sum())
                ld.padded += n - int(compared.sum())
                ld.same_set += int(p.same_set.sum())
                ld.overlap_sum += int(p.overlap[compared].sum())
                if p.dw is not None:
                    weights_compared = True
                    ld.weight_rows += int(p.wrows.sum())
                    ld.weight_count += int(p.wrows.sum()) * K
                    ld.weight_max = max(ld.weight_max, float(p.dw.max()) if n else 0.0)
                    ld.weight_sum += float(p.dw.double().sum())
                    ld.weight_max_ulps = max(ld.weight_max_ulps, float(p.dw_ulps[p.wrows].max())
                                             if bool(p.wrows.any()) else 0.0)
                differs = compared & (p.cls > 0)
                if first is not None:
                    d = differs.cpu()
                    seen[start:start + n] |= compared.cpu()
                    fresh = d & (first[start:start + n] < 0)
                    first[start:start + n][fresh] = layer
                    ld.first_divergence += int(fresh.sum())
                if len(examples) < MAX_EXAMPLES and bool(differs.any()):
                    for i in differs.nonzero().flatten()[: MAX_EXAMPLES - len(examples)].tolist():
                        offs = offsets[layer]
                        row = start + i
                        step = bisect.bisect_right(offs, row) - 1
                        examples.append(DiffExample(
                            rank, layer, step, row - offs[step], CLASSES[int(p.cls[i])],
                            ra.ids[i].tolist(), rb.ids[i].tolist(),
                            None if ra.weights is None else ra.weights[i].tolist(),
                            None if rb.weights is None else rb.weights[i].tolist()))
                start += n
                if progress is not None:
                    progress(n)
        if first is not None:
            tokens += int(seen.sum())
            tokens_differing += int((first >= 0).sum())
    notes = []
    if not ties_judged:
        notes.append("neither source holds logits: no difference can be judged a near-tie")
    if not weights_compared:
        notes.append("a source holds no weights: weights not compared")
    if not token_measures:
        notes.append("layers hold different steps: per-token measures (share differing, first layer) not given")
    result = DiffResult(
        source_a=str(a.path), source_b=str(b.path), holds_a=_holds(a, units, kernel and kernel[0]),
        holds_b=_holds(b, units, kernel and kernel[0]),
        num_experts=max(a.num_experts, b.num_experts), topk=K, align=align, kernel=None if kernel is None else kernel[0], tie_ulps=tie_ulps, weight_ulps=weight_ulps,
        ignore_ties=ignore_ties, ignore_order=ignore_order, max_flip_rate=max_flip_rate,
        layers=[per_layer[k] for k in sorted(per_layer)], ties_judged=ties_judged,
        weights_compared=weights_compared, tokens=tokens if token_measures else None,
        tokens_differing=tokens_differing if token_measures else None, examples=examples, notes=notes,
        partial=a.partial() + b.partial())
    return result


def _holds(s: Source, units, kernel: str | None) -> str:
    kinds = sorted({s.holds(r, layer) for r, layer in units})
    what = {"recorded": "recorded ids", "logits": f"logits routed by {kernel or 'the reference'}"}
    return f"{s.kind}: " + " and ".join(what[k] for k in kinds)
