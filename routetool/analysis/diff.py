"""``routetool diff A B``: where and why two routings of the same tokens differ.

Two sources hold the same tokens (traces, run folders, ids-only traces, the engines' routing
outputs), each classified once (:func:`routetool.io.inputs.classify`); each gives, per layer,
the routing of every token row: its recorded ``topk_ids`` / ``topk_weights`` where it holds
them, else its logits routed by the reference with its own router spec; a kernel under test,
where one is asked for a side, routes that side's logits wherever it holds them. The sources are
aligned layer by layer (and rank by rank for run folders; or layer i with layer i,
``pair_layers``), then by request and token position where both name them (the engines'
outputs, in any order of requests), else by step and row (the same number of tokens in every
step), or by row alone (``align="rows"``). Both are streamed, chunk by chunk, and every aligned
piece of rows is measured at once, on the device:

* each token row (a *token-layer*) falls in one class: ``same`` (same ids in the same slots,
  weights equal within ``weight_ulps``), ``weights`` (same ids and slots, a weight further apart),
  ``order`` (the same set of experts in other slots: a slot-order flip), ``tie`` (another set,
  every expert that differs inside a near-tie at the k-th pick), ``real`` (another set, outside
  a near-tie, or a row padded on one side only); rows padded on both sides are not compared;
* a near-tie is judged by the biased selection keys of each side that holds logits: by the keys
  of one side at least, each expert picked by one side only has a key within ``tie_ulps``
  float32 ulps of that side's k-th largest key (:func:`routetool.engine.compare.float32_ulp`;
  0 = exact ties): the row's *margin*, the largest such distance in ulps (the smaller of the two
  sides'), is at most ``tie_ulps``. Without logits on either side no difference can be judged a
  tie (``ties_judged`` False);
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
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from routetool.engine.compare import float32_ulp
from routetool.errors import EXIT_FINDINGS, EXIT_OK, RouteToolError

PIECE_ROWS = 1 << 16
"""Rows measured at once (bounds the ``[rows, K, K]`` id comparison)."""

CPU_PIECE_BYTES = 16 * 2**20
"""Bytes of ``[rows, E]`` float32 keys read, routed and measured at once on the CPU (on a GPU, the
engine's chunk, :data:`routetool.engine.stream.DEFAULT_CHUNK_BYTES`, and :data:`PIECE_ROWS`).
Every step of the reference makes a buffer of this size; glibc serves one of 32 MiB or more by
a fresh ``mmap`` whose pages are faulted in on first touch (about as long as the arithmetic),
and one below that from memory the last piece freed (the routing then about 1.5x faster)."""

MAX_EXAMPLES = 8
"""First differing rows kept for the report."""

MAX_TOKENS_LISTED = 32
"""First diverging tokens listed (with the layer where each first differs); all are counted."""

MARGIN_EDGES_ULPS = (0.0, 1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 16384.0, float(1 << 20))
"""Upper edges of the margin histogram, in float32 ulps of the k-th key: bins ``[0]``, ``(0, 1]``,
``(1, 4]``, ..., ``(2^14, 2^20]`` and a last bin above ``2^20`` (infinite and undefined margins
included)."""

CLASSES = ("same", "weights", "order", "tie", "real")

ALIGNS = ("auto", "requests", "steps", "rows")
"""How rows are aligned: ``requests`` by request and token position, ``steps`` by step and row,
``rows`` by row alone; ``auto``: by request where both sources name them, else by step."""


# ---------------------------------------------------------------------------------------
# sources
@dataclass
class Rows:
    """Aligned rows of one side: ``ids`` ``[n, K]`` int64 (-1 padded), ``weights`` ``[n, K]``
    float32 or None, ``padded`` ``[n]`` bool; the biased selection keys that judge near-ties,
    ``biased`` ``[n, E]`` float32 with ``kth`` ``[n, 1]`` float32, each row's K-th largest key,
    where routing made them, else computed on demand from ``gating`` ``[n, E]`` (logits beside
    recorded ids) by ``keyer``; neither: no logits."""

    ids: torch.Tensor
    weights: torch.Tensor | None
    padded: torch.Tensor
    biased: torch.Tensor | None = None
    gating: torch.Tensor | None = None
    keyer: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    kth: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def has_keys(self) -> bool:
        return self.biased is not None or self.gating is not None

    def keys(self, rows: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """``([m, E], [m, 1])`` float32: the selection keys of ``rows`` (``[m]`` indices, or a
        slice) and each row's K-th largest key."""
        if self.biased is not None:
            return self.biased[rows], self.kth[rows]
        return self.keyer(self.gating[rows])

    def cut(self, a: int, b: int) -> Rows:
        def c(t):
            return None if t is None else t[a:b]
        return Rows(self.ids[a:b], c(self.weights), self.padded[a:b], c(self.biased), c(self.gating), self.keyer,
                    c(self.kth))


def _route_logits(router, spec, gating: torch.Tensor, bias: torch.Tensor, pad: torch.Tensor | None, chunk,
                  path: str, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weights, ids, biased, kth)`` of logits: the reference, or ``router`` (a kernel) with the
    reference's keys for judging ties; ``kth`` ``[n, 1]``: each row's K-th largest key, the key of
    the reference's K-th pick (:func:`routetool_kernels.reference.kth_key`)."""
    from routetool_kernels import reference

    try:
        weights, ids, _, biased = reference.route(gating, bias, spec, is_padding=pad)
    except (ValueError, NotImplementedError) as exc:
        raise RouteToolError(f"cannot route its logits ({exc})", path=path, tensor=f"layers.{layer}.gating_output",
                             fix="check the router in its metadata") from None
    kth = reference.kth_key(biased, ids)
    if router is not None:
        routed = router.route_or_raise(chunk, bias, path)
        weights, ids = routed.weights.float(), routed.ids
    return weights, ids, biased, kth


class RouteMemo:
    """The reference's last routing, reused when the other side asks for the same logits, bias,
    padding and router: a source diffed with itself, or two captures whose logits agree bit for
    bit, are routed once. A kernel under test is never memoised: each side's calls are its own
    (a kernel that answers one input two ways is a difference to find)."""

    def __init__(self) -> None:
        self._last = None

    @staticmethod
    def _same(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
        if x is None or y is None:
            return x is y
        return (x.shape == y.shape and x.dtype == y.dtype and x.device == y.device
                and (x.data_ptr() == y.data_ptr() and x.stride() == y.stride() or torch.equal(x, y)))

    def route(self, spec, gating: torch.Tensor, bias: torch.Tensor, pad: torch.Tensor | None,
              compute: Callable[[], tuple]) -> tuple:
        last = self._last
        if (last is not None and last[0] == spec and self._same(last[2], bias) and self._same(last[3], pad)
                and self._same(last[1], gating)):  # (the logits last: the largest to compare)
            self._last = None  # (one reuse: the pair is consumed)
            return last[4]
        out = compute()
        self._last = (spec, gating, bias, pad, out)
        return out


class Source:
    """One side of a diff (a trace, sharded trace, run folder, or an engine's routing dump),
    classified once (:func:`routetool.io.inputs.classify`).

    Attributes:
        path: as given. label: ``A`` or ``B``. kind: ``trace``, ``sharded trace``, ``run folder``
            or the dump's format. num_experts / topk: E and K. spec: the router spec (None for a
            dump without one). units: ``(rank, layer)`` pairs it holds (rank None for a single
            trace or a dump).

    Raises:
        RouteToolError: the path cannot be read, or holds per-expert counts (no per-token routing).
    """

    def __init__(self, path: Path, label: str, *, topk: int | None = None, read: bool = True):
        from routetool.io.inputs import classify

        self.path, self.label = Path(path), label
        self._inp = classify(self.path)
        self._input = self._imported = None
        self.layer_map: dict[int, int] = {}  # layer as the diff numbers it -> this source's (--pair-layers)
        if read:
            self.read(topk)

    @property
    def needs_topk(self) -> bool:
        """Whether the source is an engine output that does not record its top-k (SGLang's routed
        experts, a flat array), which :meth:`read` then needs."""
        return self._inp.kind == "dump" and self._inp.format == "sglang-routed"

    def read(self, topk: int | None = None) -> None:
        """Open the trace, or read the dump (``topk``: K for a dump that does not record it).

        Raises:
            RouteToolError: the path cannot be read, or holds per-expert counts (no per-token routing).
        """
        from routetool.io.inputs import open_classified

        inp = self._inp
        refuse = (f"diff compares per-token routing; analyse its load with `routetool balance "
                  f"{shlex.quote(str(self.path))}`")
        if inp.kind == "counts":
            raise RouteToolError("holds per-expert counts, not per-token routing", path=self.path, fix=refuse)
        if inp.kind == "dump":
            from routetool.io.dumps import ImportOptions, read_dump

            self.kind = inp.format
            options = ImportOptions(refuse_counts=refuse, topk=topk if self.needs_topk else None)
            self._imported = read_dump(self.path, options, classified=inp.format)
            self.spec = self._imported.router
            self.num_experts, self.topk = self._imported.num_experts, self._imported.topk
            self.units = [(None, layer) for layer in sorted(self._imported.layers)]
        else:
            self.kind = {"index": "sharded trace"}.get(inp.kind, inp.kind)
            self._input = open_classified(inp)
            self.spec = self._input.meta.router
            self.num_experts, self.topk = self.spec.num_experts, self.spec.topk
            self._traces = {r.rank: r.trace for r in self._input.ranks}
            self.units = [(r.rank, layer) for r in self._input.ranks for layer in r.trace.layers]

    @property
    def ranks(self) -> list:
        return sorted({r for r, _ in self.units}, key=lambda r: -1 if r is None else r)

    def layers(self, rank) -> list[int]:
        return sorted(layer for r, layer in self.units if r == rank)

    def step_offsets(self, rank, layer: int) -> list[int]:
        layer = self.layer_map.get(layer, layer)
        if self._input is not None:
            return list(self._traces[rank].info(layer).step_offsets)
        return list(self._imported.layers[layer].step_offsets)

    def holds(self, rank, layer: int, kernel: bool = False) -> str:
        """What the routing comes from: ``recorded`` ids or ``logits``; ``kernel``: a kernel is
        asked for this source, which routes its logits wherever it holds them (recorded ids
        beside them are then left aside)."""
        if kernel and self.has_logits(rank, layer):
            return "logits"
        layer = self.layer_map.get(layer, layer)
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
        return None if self._imported is None else self._imported.layers[self.layer_map.get(layer, layer)].positions

    def requests(self, layer: int) -> tuple[list[str], list[int], torch.Tensor] | None:
        """``(step labels, step offsets, [T] int64 positions)`` where the source names every token
        of ``layer`` by its request (one step each) and its position in it (the engines' outputs
        that record them: vLLM and SGLang routed experts, Megatron files), else None."""
        labels, positions = self.step_labels(), self.positions(layer)
        if labels is None or positions is None:
            return None
        return labels, self.step_offsets(None, layer), positions

    def has_logits(self, rank, layer: int) -> bool:
        layer = self.layer_map.get(layer, layer)
        if self._input is not None:
            return self._traces[rank].info(layer).has_logits
        return self._imported.layers[layer].gating_output is not None

    def rows(self, rank, layer: int, device: torch.device, kernel=None, *, order: torch.Tensor | None = None,
             memo: RouteMemo | None = None) -> Iterator[Rows]:
        """The layer's rows in order, in chunks (a trace streamed from disk by the engine).

        ``kernel``: ``(name, fn)`` routing logits-only layers with this source's spec, once per
        captured step (None: the reference). ``order``: ``[T]`` int64, the rows in this order
        (request alignment; a dump only). ``memo``: shared by both sides (:class:`RouteMemo`).
        """
        router = None
        if kernel is not None and kernel[1] is not None and self.spec is not None:
            from routetool.engine.router import Router

            router = Router(self.spec, kernel[1], kernel[0])
        force = kernel is not None  # (its logits routed wherever it holds them)
        memo = memo or RouteMemo()
        layer = self.layer_map.get(layer, layer)
        if self._input is not None:
            pieces = self._trace_rows(self._traces[rank], layer, device, router, memo, force)
        else:
            pieces = self._dump_rows(layer, device, router, order, memo, force)
        start = 0
        for rows in pieces:
            self._check_ids(rows, layer, start, router)
            start += len(rows)
            yield rows

    def _check_ids(self, rows: Rows, layer: int, start: int, router) -> None:
        """Every expert id in ``[0, E)``, or -1 (padding): the measures index by them.

        Raises:
            KernelError: ids the kernel under test returned (exit 1).
            RouteToolError: ids the source recorded (exit 2), naming the first such row.
        """
        E = self.num_experts
        if E is None:
            return
        bad = ((rows.ids < -1) | (rows.ids >= E)).any(-1)
        if not bool(bad.any()):
            return
        r = int(bad.to(torch.int8).argmax())
        value = [v for v in rows.ids[r].tolist() if not -1 <= v < E][0]
        where = f"layer {layer}, row {start + r}"
        if router is not None and rows.gating is None and rows.biased is not None:  # (the kernel's own outputs)
            from routetool.errors import KernelError

            raise KernelError(f"kernel {router.name!r} returned expert id {value} outside [0, {E}) on {where}",
                              failure_class="invalid", path=self.path, fix="fix the kernel's top-k ids")
        raise RouteToolError(f"holds expert id {value} outside [0, {E}) on {where}", path=self.path,
                             fix=f"check the recording: ids are 0..{E - 1}, or -1 on padded rows")

    def _keyer(self, bias: torch.Tensor, path: str, layer: int
               ) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        def keys(gating: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return _route_logits(None, self.spec, gating, bias, None, None, path, layer)[2:]
        return keys

    def _trace_rows(self, trace, layer: int, device: torch.device, router, memo: RouteMemo,
                    force: bool) -> Iterator[Rows]:
        from routetool.engine.stream import stream_layer

        path = str(trace.display_path)
        recorded = trace.info(layer).has_recorded_ids and not (force and trace.info(layer).has_logits)
        bias = trace.bias(layer).to(device)
        keyer = self._keyer(bias, path, layer)
        budget = CPU_PIECE_BYTES if device.type == "cpu" else None
        for chunk in stream_layer(trace, layer, device, budget_bytes=budget,
                                  whole_steps=router is not None and not recorded):
            pad = chunk.is_padding
            biased = gating = kth = None
            if recorded:  # (logits beside recorded ids judge ties only: keyed on demand, for differing rows)
                ids = chunk.recorded_ids.long()
                weights = None if chunk.recorded_weights is None else chunk.recorded_weights.float()
                gating = chunk.gating_output
            else:
                def compute(chunk=chunk, pad=pad):
                    return _route_logits(router, self.spec, chunk.gating_output, bias, pad, chunk, path, layer)
                weights, ids, biased, kth = (compute() if router is not None
                                             else memo.route(self.spec, chunk.gating_output, bias, pad, compute))
                ids = ids.long()
            padded = (ids < 0).all(-1)
            padded = padded if pad is None else pad.to(device) | padded
            yield Rows(ids, weights, padded, biased=biased, gating=gating, keyer=None if gating is None else keyer,
                       kth=kth)

    def _kernel_routed(self, x, layer: int, bias: torch.Tensor, router, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, ids)`` ``[T, K]`` of a dump's logits routed by the kernel under test, once
        per step (the engine's call), in chunks of whole steps."""
        from routetool.engine.stream import Chunk, check_step_sizes, chunk_budget, plan_chunks

        E = self.num_experts
        o = list(x.step_offsets)
        check_step_sizes([b - a for a, b in zip(o, o[1:])], 4 * E, f"{E:,} experts' float32 scores", path=self.path,
                         tensor=f"layer {layer}", fix="diff it with the reference, which reads any step in pieces")
        weights, ids = [], []
        for f, e in plan_chunks(o, 4 * max(E, 1), chunk_budget()):
            chunk = Chunk(layer=layer, first_step=f, start=o[f], offsets=[v - o[f] for v in o[f:e + 1]],
                          gating_output=x.gating_output[o[f]:o[e]].to(device), is_padding=None, recorded_ids=None,
                          recorded_weights=None)
            routed = router.route_or_raise(chunk, bias, str(self.path))
            weights.append(routed.weights.float())
            ids.append(routed.ids.long())
        return torch.cat(weights), torch.cat(ids)

    def _dump_rows(self, layer: int, device: torch.device, router, order: torch.Tensor | None,
                   memo: RouteMemo, force: bool) -> Iterator[Rows]:
        x = self._imported.layers[layer]
        n, E = x.num_tokens, max(self.num_experts or 1, 1)
        ids_all, weights_all, gating, keyer, bias = x.topk_ids, x.topk_weights, x.gating_output, None, None
        if gating is not None:
            if self.spec is None:
                raise RouteToolError("holds logits but names no router to route them", path=self.path,
                                     fix="import it with its router: `routetool import`")
            bias = (x.bias if x.bias is not None else torch.zeros(self.num_experts)).float().to(device)
            keyer = self._keyer(bias, str(self.path), layer)
            if router is not None:  # (a kernel routes logits wherever they are)
                weights_all, ids_all = self._kernel_routed(x, layer, bias, router, device)
            elif force:  # (the reference, asked for: routed below)
                weights_all = ids_all = None
        piece = PIECE_ROWS if device.type != "cpu" else max(1, min(PIECE_ROWS, CPU_PIECE_BYTES // (4 * E)))
        for a in range(0, n, piece):
            b = min(n, a + piece)
            sel = None if order is None else order[a:b]

            def take(t, sel=sel, a=a, b=b):
                if t is None:
                    return None
                return (t[a:b] if sel is None else t[sel.to(t.device)]).to(device)

            g = take(gating)
            if ids_all is not None:
                ids = take(ids_all).long()
                weights = take(weights_all)
                rows = Rows(ids, None if weights is None else weights.float(), (ids < 0).all(-1), gating=g,
                            keyer=keyer)
            else:
                def compute(g=g):
                    return _route_logits(None, self.spec, g, bias, None, None, str(self.path), layer)
                w, i, biased, kth = memo.route(self.spec, g, bias, None, compute)
                i = i.long()
                rows = Rows(i, w, (i < 0).all(-1), biased=biased, kth=kth)
            yield rows

    def close(self) -> None:
        if self._input is not None:
            self._input.close()
            self._input = None


def open_sources(path_a: Path, path_b: Path, *, topk: int | None = None) -> tuple[Source, Source]:
    """The two sides of a diff, each classified once and read; an engine output that does not
    record its top-k (:attr:`Source.needs_topk`) takes ``topk``, else the other side's.

    Raises:
        RouteToolError: as :class:`Source` does (nothing is left open).
    """
    a, b = Source(path_a, "A", read=False), Source(path_b, "B", read=False)
    first, second = (b, a) if a.needs_topk and not b.needs_topk else (a, b)
    first.read(topk)
    try:
        second.read(topk if topk is not None or not second.needs_topk else first.topk)
    except BaseException:
        first.close()
        raise
    return a, b


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
    """One differing row: where (in A's steps; the request and token position where the sources
    are aligned by request), its class, both sides' ids and weights."""

    rank: int | None
    layer: int
    step: int
    row: int
    cls: str
    ids_a: list[int]
    ids_b: list[int]
    weights_a: list[float] | None
    weights_b: list[float] | None
    request: str | None = None
    position: int | None = None


@dataclass
class TokenDivergence:
    """A token that differs in some layer: its rank, its row in A's layers (``token``), step and
    row in that step (and request and position where aligned by request), and ``layer``, the
    first layer (ascending) where it differs."""

    rank: int | None
    token: int
    step: int
    row: int
    layer: int
    request: str | None = None
    position: int | None = None


@dataclass
class Margins:
    """The k-th-pick margins of the rows holding another set of experts (classes ``tie`` and
    ``real``), in float32 ulps of the k-th key (see the module docstring): ``tie[i]`` and
    ``real[i]`` count the rows of each class in bin ``i`` of :data:`MARGIN_EDGES_ULPS`;
    ``not_judged``: rows of class ``real`` with no margin (no logits on either side, or padded on
    one side only)."""

    tie: list[int] = field(default_factory=lambda: [0] * (len(MARGIN_EDGES_ULPS) + 1))
    real: list[int] = field(default_factory=lambda: [0] * (len(MARGIN_EDGES_ULPS) + 1))
    not_judged: int = 0

    @staticmethod
    def bins() -> list[tuple[float, float]]:
        """``(low, high)`` of each bin in ulps: ``(0, 0)`` for exact ties, then ``(low, high]``."""
        edges = (0.0, *MARGIN_EDGES_ULPS, float("inf"))
        return [(0.0, 0.0)] + list(zip(edges[1:-1], edges[2:]))


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
    margins: Margins = field(default_factory=Margins)
    first_tokens: list[TokenDivergence] = field(default_factory=list)
    kernel_b: str | None = None

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
        """The layers that differ, worst first: by rows routed to other experts outside near-ties
        (real disagreements), then by share of rows differing in any way; at most ``n``, and every
        layer with a real disagreement however many that is (none is left off the summary)."""
        bad = sorted((x for x in self.layers if x.differing),
                     key=lambda x: (-x.classes["real"], -(x.differing / x.rows), x.layer))
        return bad[:max(n, sum(1 for x in bad if x.classes["real"]))]


def _sorted_by_id(ids: torch.Tensor, weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    s, order = ids.sort(-1)
    return s, None if weights is None else weights.gather(-1, order)


def _margin(keys: torch.Tensor, kth: torch.Tensor, ids_a: torch.Tensor, ids_b: torch.Tensor, in_b: torch.Tensor,
            in_a: torch.Tensor) -> torch.Tensor:
    """``[n]`` float32: the largest ``|key[e] - kth|``, in float32 ulps of ``kth`` (``[n, 1]``, the
    k-th largest key of the row, ``keys`` ``[n, E]``), over the experts ``e`` picked by one side
    only; NaN where a key is undefined (infinite keys). A row is inside a near-tie of this routing
    when it is at most ``tie_ulps`` (ulps are powers of two: the division is exact)."""
    ulp = float32_ulp(kth)

    def side(ids: torch.Tensor, other_has: torch.Tensor) -> torch.Tensor:
        d = (keys.gather(-1, ids.clamp_min(0)) - kth).abs() / ulp
        return torch.where(other_has, 0.0, d).amax(-1)  # (NaN propagates: never a near-tie)

    return torch.maximum(side(ids_a, in_b), side(ids_b, in_a))


@dataclass
class _Piece:
    """What :func:`measure` finds in a piece of aligned rows."""

    cls: torch.Tensor  # [n] int8 index into CLASSES, -1 = padded on both sides
    same_set: torch.Tensor  # [n] bool, rows padded on both sides excluded
    overlap: torch.Tensor  # [n] |A ∩ B|
    wrows: torch.Tensor | None  # [n] bool: weights compared (same set, both sides with weights), or None
    dw_sum: torch.Tensor | None = None  # () float64 sum of |ΔW| over the compared weights
    dw_max: torch.Tensor | None = None  # () largest |ΔW|
    dw_max_ulps: torch.Tensor | None = None  # () largest |ΔW| in float32 ulps of the larger weight
    margin: torch.Tensor | None = None  # [n] float32 ulps on judged rows of another set (inf: undefined), NaN
    # elsewhere; None: no row judged


def _identical(a: Rows, b: Rows) -> bool:
    """Whether two pieces hold the same ids, padding and weights, bit for bit (one pass each)."""
    if (a.weights is None) != (b.weights is None) or not torch.equal(a.ids, b.ids):
        return False
    return torch.equal(a.padded, b.padded) and (a.weights is None or torch.equal(a.weights, b.weights))


def _rows(mask: torch.Tensor, n: int) -> torch.Tensor | slice | None:
    """The rows ``mask`` (``[n]`` bool) holds, to work on: None for none, every row (a slice, so
    that nothing is gathered and scattered) when they are most of them, else their indices."""
    rows = mask.nonzero().flatten()
    if rows.numel() == 0:
        return None
    return slice(None) if 2 * rows.numel() > n else rows


def measure(a: Rows, b: Rows, topk: int, *, tie_ulps: float, weight_ulps: float) -> _Piece:
    """Classify aligned rows (see the module docstring).

    Two pieces holding the same ids, padding and weights bit for bit (a source diffed with a
    copy of itself, a replay that works) are ``same`` row for row at the cost of comparing them;
    otherwise rows with the same ids in the same slots take the cheap path, and the ``[rows, K,
    K]`` set comparison and the id-sorted weight matching run on the others only; weights are
    put in ulps where they differ only, and the selection keys are computed (or read) for the
    rows holding another set only.

    Args:
        a / b: rows of the two sides, the same ``n``. topk: K. tie_ulps: near-tie tolerance in
            float32 ulps. weight_ulps: weights this many ulps apart still count as equal.

    Returns:
        the per-row class (``[n]`` int8 index into :data:`CLASSES`, -1 padded on both sides),
        same-set flags, ``|A ∩ B|`` per row, the weight deltas (sum, max, max in ulps) and the
        k-th-pick margin of the rows of another set (:func:`_margin`, the smaller of the two
        routings').
    """
    ia, ib = a.ids, b.ids
    n = ia.shape[0]
    both_pad = a.padded & b.padded
    with_weights = a.weights is not None and b.weights is not None
    if _identical(a, b):
        valid = ia >= 0
        same_set = valid.all(-1) & ~both_pad
        zero = torch.zeros((), dtype=torch.float64, device=ia.device)
        return _Piece(torch.where(both_pad, -1, 0).to(torch.int8), same_set, valid.sum(-1),
                      same_set if with_weights else None, *((zero, zero, zero) if with_weights else (None,) * 3))
    one_pad = a.padded ^ b.padded
    same_order = (ia == ib).all(-1) & ~one_pad
    rest = _rows(~same_order, n)  # (one synchronisation per piece)
    in_b, in_a = ia >= 0, ib >= 0  # [n, K]: A's pick is among B's (right on rows of the same order)
    if rest is not None:
        ra, rb = ia[rest], ib[rest]
        in_b[rest] = (ra[:, :, None] == rb[:, None, :]).any(-1) & (ra >= 0)
        in_a[rest] = (rb[:, :, None] == ra[:, None, :]).any(-1) & (rb >= 0)
    overlap = in_b.sum(-1)
    same_set = (in_b.all(-1) & in_a.all(-1)) & ~one_pad
    wrows = dw_sum = dw_max = dw_max_ulps = None
    weights_differ = torch.zeros_like(same_order)
    if with_weights:
        wa, wb = a.weights, b.weights  # paired slot by slot, by expert id on the other rows
        if isinstance(rest, slice):
            wa, wb = _sorted_by_id(ia, wa)[1], _sorted_by_id(ib, wb)[1]
        elif rest is not None:
            wa, wb = wa.clone(), wb.clone()
            wa[rest] = _sorted_by_id(ia[rest], a.weights[rest])[1]
            wb[rest] = _sorted_by_id(ib[rest], b.weights[rest])[1]
        wrows = same_set & ~both_pad
        dw = torch.where(wrows[:, None], (wa - wb).abs(), 0.0).nan_to_num_(nan=float("inf"))
        dw_sum = dw.double().sum()
        dw_max = dw.max().double() if n else torch.zeros((), dtype=torch.float64, device=ia.device)
        dw_max_ulps = torch.zeros((), dtype=torch.float64, device=ia.device)
        moved = _rows((dw != 0).any(-1), n)  # (the ulps of the weights that differ only)
        if moved is not None:
            dw_ulps = dw[moved] / float32_ulp(torch.maximum(wa[moved].abs(), wb[moved].abs()))
            dw_max_ulps = dw_ulps.max().double()
            weights_differ[moved] = (dw_ulps > weight_ulps).any(-1) & wrows[moved]
    tie = torch.zeros_like(same_order)
    margin = None
    judged = [x for x in (a, b) if x.has_keys]
    other_rows = ~same_set & ~one_pad & ~both_pad
    other = _rows(other_rows, n) if judged else None  # judged on these rows only
    if other is not None:
        m = None
        for x in judged:  # inside a near-tie of either routing: the smaller margin
            keys, kth = x.keys(other)
            mx = _margin(keys.float(), kth.float(), ia[other], ib[other], in_b[other], in_a[other])
            m = mx if m is None else torch.fmin(m, mx)
        margin = torch.full((n,), float("nan"), device=ia.device)
        margin[other] = torch.nan_to_num(m, nan=float("inf"))
        if isinstance(other, slice):  # (every row measured: the others' margins are not margins)
            margin = torch.where(other_rows, margin, float("nan"))
        tie = other_rows & (margin <= tie_ulps)
    cls = torch.full(ia.shape[:1], 4, dtype=torch.int8, device=ia.device)  # real
    cls = torch.where(tie, 3, cls)
    cls = torch.where(same_set, 2, cls)
    cls = torch.where(same_order, torch.where(weights_differ, 1, 0), cls).to(torch.int8)
    cls = torch.where(both_pad, -1, cls).to(torch.int8)
    return _Piece(cls, same_set & ~both_pad, overlap, wrows, dw_sum, dw_max, dw_max_ulps, margin)


# ---------------------------------------------------------------------------------------
# alignment
def _request_order(a: Source, b: Source, layer: int, shown: str) -> torch.Tensor:
    """``[T]`` int64: for each row of A's ``layer``, the row of B holding the same token (the same
    request label and token position).

    Raises:
        RouteToolError: a token held twice by one source, no token in common, or tokens held by
            one source only (how many, and the first of each side).
    """
    la, oa, pa = a.requests(layer)
    lb, ob, pb = b.requests(layer)
    names: dict[str, int] = {}
    ids_a = [names.setdefault(x, len(names)) for x in la]
    ids_b = [names.setdefault(x, len(names)) for x in lb]
    label = list(names)
    top = max([int(t.max()) for t in (pa, pb) if t.numel()] or [0]) + 1

    def keys(ids, offsets, positions):
        steps = torch.repeat_interleave(torch.tensor(ids, dtype=torch.int64),
                                        torch.tensor(_sizes(offsets), dtype=torch.int64))
        return steps * top + positions.long()

    def token(key: int) -> str:
        return f"request {label[key // top]!r} position {key % top}"

    ka, kb = keys(ids_a, oa, pa), keys(ids_b, ob, pb)
    where = f"layer {layer}"
    for s, k in ((a, ka), (b, kb)):
        srt = k.sort().values
        dup = (srt[1:] == srt[:-1]).nonzero().flatten()
        if dup.numel():
            raise RouteToolError(f"cannot be aligned by request: {where}: {token(int(srt[dup[0]]))} is held twice by "
                                 f"{s.label}", path=s.path, fix="diff outputs that hold each request once")
    sorted_b, perm = kb.sort()
    at = torch.searchsorted(sorted_b, ka).clamp(max=max(len(kb) - 1, 0))
    found = sorted_b[at] == ka if len(kb) else torch.zeros(len(ka), dtype=torch.bool)
    fix = "diff outputs of the same requests, or align by order alone with --align rows"
    if not bool(found.any()):
        def reqs(labels):
            text = ", ".join(repr(x) for x in dict.fromkeys(labels))
            return text if len(text) <= 60 else text[:57] + "..."
        raise RouteToolError(f"cannot be aligned by request: the sources share no token ({where}: A holds requests "
                             f"{reqs(la)}, B {reqs(lb)})", path=shown, fix=fix)
    only_a = int((~found).sum())
    in_a = torch.zeros(len(kb), dtype=torch.bool)
    in_a[perm[at[found]]] = True
    only_b = int((~in_a).sum())
    if only_a or only_b:
        parts = []
        if only_a:
            parts.append(f"{only_a:,} of A's {len(ka):,} tokens are not in B (first: "
                         f"{token(int(ka[(~found).nonzero()[0]]))})")
        if only_b:
            parts.append(f"{only_b:,} of B's {len(kb):,} tokens are not in A (first: "
                         f"{token(int(kb[(~in_a).nonzero()[0]]))})")
        raise RouteToolError(f"cannot be aligned by request: the token sets differ: {where}: " + "; ".join(parts),
                             path=shown, fix=fix)
    return perm[at]


def check_aligned(a: Source, b: Source, layers: list[int] | None, align: str, *, pair_layers: bool = False
                  ) -> tuple[list[tuple], str, dict[int, torch.Tensor]]:
    """The ``(rank, layer)`` units both sources hold, checked to hold the same tokens; the
    alignment used (``align``, with ``auto`` resolved: ``requests`` where both sources name
    requests and token positions, else ``steps``); and, aligned by request, B's rows in A's
    order per layer (:func:`_request_order`). ``pair_layers``: A's i-th layer is compared with B's
    i-th (an engine numbering hidden layers against a trainer numbering MoE layers), under A's
    numbers (``b.layer_map``); ``layers`` then names A's.

    Raises:
        RouteToolError: other experts or top-k, other ranks, other layers, other tokens per step
            (``align="steps"``) or per layer (``align="rows"``), other requests or positions
            (``align="requests"``: no token in common, or tokens held by one side only), a source
            that names no requests under ``align="requests"``, or ``layers`` not held by both.
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
        if pair_layers:
            if len(la) != len(lb):
                raise RouteToolError(f"cannot be aligned: --pair-layers pairs layers by order, but A holds {len(la)} "
                                     f"({_span(la)}), B {len(lb)} ({_span(lb)})", path=shown, fix=fix)
            if rank == a.ranks[0]:
                b.layer_map = dict(zip(la, lb))
            elif b.layer_map != dict(zip(la, lb)):
                raise RouteToolError(f"cannot be aligned: --pair-layers: rank {rank} holds other layers", path=shown,
                                     fix="diff the ranks one by one")
            lb = la
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
            units.append((rank, layer))
    if not units:
        return units, "steps" if align == "auto" else align, {}
    both = all(a.requests(layer) is not None and b.requests(layer) is not None for _, layer in units)
    if align == "auto":
        align = "requests" if both else "steps"
    if align == "requests":
        if not both:
            s = a if any(a.requests(layer) is None for _, layer in units) else b
            raise RouteToolError(f"cannot be aligned by request: {s.label} ({s.kind}) names no requests and token "
                                 "positions", path=s.path, fix="align by step with --align steps, or by row with "
                                                              "--align rows")
        orders, cache = {}, {}
        for _, layer in units:
            key = (tuple(a.step_offsets(None, layer)), tuple(b.step_offsets(None, layer)), id(a.positions(layer)),
                   id(b.positions(layer)))
            if key not in cache:
                cache[key] = _request_order(a, b, layer, shown)
            orders[layer] = cache[key]
        return units, align, orders
    for rank, layer in units:
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
        if align == "steps" and pa is not None and pb is not None and not torch.equal(pa, pb):
            row = int((pa != pb).nonzero()[0]) if pa.shape == pb.shape else 0
            raise RouteToolError(f"cannot be aligned: {where}: row {row} is token position {int(pa[row])} in A, "
                                 f"{int(pb[row])} in B", path=shown, fix="align by request with --align requests, "
                                                                         "or by row alone with --align rows")
    la, lb = a.step_labels(), b.step_labels()
    if align == "steps" and both and la != lb:
        i = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), 0)
        raise RouteToolError(f"cannot be aligned: step {i} is request {la[i]!r} in A, {lb[i]!r} in B", path=shown,
                             fix="align by request with --align requests, or by row alone with --align rows")
    return units, align, {}


def _sizes(offsets: list[int]) -> list[int]:
    return [y - x for x, y in zip(offsets, offsets[1:])]


def _span(layers: list[int]) -> str:
    return ",".join(map(str, layers)) if layers else "none"


# ---------------------------------------------------------------------------------------
# the diff
class _LayerSums:
    """One layer's measures summed on the device over its pieces (no host synchronisation per
    piece but the one :func:`measure` makes), read back once (:meth:`into`)."""

    def __init__(self, device: torch.device) -> None:
        nb = len(MARGIN_EDGES_ULPS) + 1
        self.classes = torch.zeros(len(CLASSES) + 1, dtype=torch.int64, device=device)  # [padded, *CLASSES]
        self.ints = torch.zeros(4, dtype=torch.int64, device=device)  # same_set, overlap, weight_rows, first
        self.weight = torch.zeros(3, dtype=torch.float64, device=device)  # sum, max, max ulps
        self.margins = torch.zeros(2 * nb, dtype=torch.float64, device=device)  # tie bins, real bins
        self.edges = torch.tensor(MARGIN_EDGES_ULPS, dtype=torch.float32, device=device)
        self.weights_seen = False

    def add(self, p: _Piece, compared: torch.Tensor, fresh: torch.Tensor | None) -> None:
        self.classes += torch.bincount(p.cls.long() + 1, minlength=len(CLASSES) + 1)
        zero = compared.new_zeros((), dtype=torch.int64)
        parts = [p.same_set.sum(), torch.where(compared, p.overlap, 0).sum(),
                 p.wrows.sum() if p.wrows is not None else zero, fresh.sum() if fresh is not None else zero]
        self.ints += torch.stack([x.long() for x in parts])
        if p.margin is not None:
            judged = ~torch.isnan(p.margin)
            bins = torch.bucketize(p.margin.nan_to_num(nan=0.0), self.edges)
            nb = len(MARGIN_EDGES_ULPS) + 1
            self.margins += torch.bincount(bins + nb * (p.cls == 4).long(),
                                           weights=(judged & ((p.cls == 3) | (p.cls == 4))).double(), minlength=2 * nb)
        if p.dw_sum is not None:
            self.weights_seen = True
            self.weight[0] += p.dw_sum
            self.weight[1] = torch.maximum(self.weight[1], p.dw_max)
            self.weight[2] = torch.maximum(self.weight[2], p.dw_max_ulps)

    def into(self, ld: LayerDiff, margins: Margins, topk: int) -> None:
        counts = self.classes.tolist()
        ld.padded += counts[0]
        for name, c in zip(CLASSES, counts[1:]):
            ld.classes[name] += c
        ld.rows += sum(counts[1:])
        same_set, overlap, wrows, first = self.ints.tolist()
        ld.same_set += same_set
        ld.overlap_sum += overlap
        ld.first_divergence += first
        ld.weight_rows += wrows
        ld.weight_count += wrows * topk
        ws, wm, wu = self.weight.tolist()
        ld.weight_sum += ws
        ld.weight_max = max(ld.weight_max, wm)
        ld.weight_max_ulps = max(ld.weight_max_ulps, wu)
        m = [int(round(x)) for x in self.margins.tolist()]
        nb = len(MARGIN_EDGES_ULPS) + 1
        margins.tie = [x + y for x, y in zip(margins.tie, m[:nb])]
        margins.real = [x + y for x, y in zip(margins.real, m[nb:])]
        margins.not_judged += counts[1 + CLASSES.index("real")] - sum(m[nb:])  # (real rows with no margin)


def diff_sources(a: Source, b: Source, *, layers: list[int] | None = None, align: str = "auto",
                 tie_ulps: float = 16.0, weight_ulps: float = 0.0, ignore_ties: bool = False,
                 ignore_order: bool = False, max_flip_rate: float | None = None,
                 device: torch.device | None = None, kernel=None, kernel_b=None, pair_layers: bool = False,
                 progress=None) -> DiffResult:
    """Diff the routing of two aligned sources (see the module docstring).

    Args:
        a / b: the sources. layers: the layers to compare (default: all, which must agree).
        align: one of :data:`ALIGNS`.
        tie_ulps / weight_ulps: tolerances in float32 ulps. ignore_ties / ignore_order /
            max_flip_rate: the thresholds of the verdict. device: where to measure (CPU).
        kernel: ``(name, fn)``, the kernel under test that routes each side's logits (recorded ids
            beside them left aside) with the side's own router spec (None: the reference).
            kernel_b: B's instead (``(name, fn)``, ``(name, None)`` for the reference; None:
            ``kernel``): the reference against a kernel, or a kernel before and after a change,
            on the same logits. pair_layers: A's i-th layer against B's i-th (:func:`check_aligned`).
            progress: called with the rows of each aligned piece.

    Raises:
        RouteToolError: the sources cannot be aligned (:func:`check_aligned`) or read; a
            kernel while no source it routes holds logits alone (nothing for it to route).
    """
    device = torch.device("cpu" if device is None else device)
    units, align, orders = check_aligned(a, b, layers, align, pair_layers=pair_layers)
    kernels = {"A": kernel, "B": kernel if kernel_b is None else kernel_b}
    names = {k: None if v is None else v[0] for k, v in kernels.items()}
    routed = {s.label: any(s.holds(r, layer, kernels[s.label] is not None) == "logits" for r, layer in units)
              for s in (a, b)}
    asked = [k for k in ("A", "B") if kernels[k] is not None]
    if asked and not any(routed[k] for k in asked):
        flags = [f"{flag} {k[0]}" for flag, k in (("--kernel", kernel), ("--kernel-b", kernel_b)) if k is not None]
        raise RouteToolError(f"{' and '.join(flags)} route{'' if len(flags) > 1 else 's'} logits, but "
                             f"{'neither source holds' if len(asked) == 2 else 'B does not hold'} logits alone (A: "
                             f"{_holds(a, units, kernels['A'])}; B: {_holds(b, units, kernels['B'])})",
                             path=f"{a.path} and {b.path}",
                             fix="drop the kernel to compare the routing they record, or diff a logits-only trace of "
                                 "the same tokens")
    K = a.topk
    per_layer: dict[int, LayerDiff] = {}
    examples: list[DiffExample] = []
    first_tokens: list[TokenDivergence] = []
    margins = Margins()
    memo = RouteMemo()
    ties_judged = weights_compared = False
    tokens = tokens_differing = 0
    token_measures = True
    requests = a.requests if align == "requests" else (lambda layer: None)
    for rank in a.ranks:
        rank_units = [layer for r, layer in units if r == rank]
        offsets = {layer: a.step_offsets(rank, layer) for layer in rank_units}
        same_tokens = len({tuple(o) for o in offsets.values()}) <= 1
        token_measures &= same_tokens
        n_tok = offsets[rank_units[0]][-1] if rank_units else 0
        first = torch.full((n_tok,), -1, dtype=torch.int32, device=device) if same_tokens else None
        seen = torch.zeros(n_tok, dtype=torch.bool, device=device) if same_tokens else None
        for layer in rank_units:
            ld = per_layer.setdefault(layer, LayerDiff(layer))
            ties_judged |= a.has_logits(rank, layer) or b.has_logits(rank, layer)
            sums = _LayerSums(device)
            start = 0
            req = requests(layer)
            rows_a = a.rows(rank, layer, device, kernels["A"], memo=memo)
            rows_b = b.rows(rank, layer, device, kernels["B"], order=orders.get(layer), memo=memo)
            for ra, rb in _aligned(rows_a, rows_b):
                n = len(ra)
                p = measure(ra, rb, K, tie_ulps=tie_ulps, weight_ulps=weight_ulps)
                compared = p.cls >= 0
                differs = compared & (p.cls > 0)
                fresh = None
                if first is not None:
                    seen[start:start + n] |= compared
                    fresh = differs & (first[start:start + n] < 0)
                    first[start:start + n] = torch.where(fresh, layer, first[start:start + n])
                sums.add(p, compared, fresh)
                if len(examples) < MAX_EXAMPLES:
                    for i in differs.nonzero().flatten()[: MAX_EXAMPLES - len(examples)].tolist():
                        step, row, request, position = _where(offsets[layer], req, start + i)
                        examples.append(DiffExample(
                            rank, layer, step, row, CLASSES[int(p.cls[i])], ra.ids[i].tolist(), rb.ids[i].tolist(),
                            None if ra.weights is None else ra.weights[i].tolist(),
                            None if rb.weights is None else rb.weights[i].tolist(), request, position))
                start += n
                if progress is not None:
                    progress(n)
            sums.into(ld, margins, K)
            weights_compared |= sums.weights_seen
        if first is not None:
            tokens += int(seen.sum())
            diverged = (first >= 0).nonzero().flatten()
            tokens_differing += int(diverged.numel())
            req = requests(rank_units[0]) if rank_units else None
            for t in diverged[: max(0, MAX_TOKENS_LISTED - len(first_tokens))].tolist():
                step, row, request, position = _where(offsets[rank_units[0]], req, t)
                first_tokens.append(TokenDivergence(rank, t, step, row, int(first[t]), request, position))
    notes = []
    if not ties_judged:
        notes.append("neither source holds logits: no difference can be judged a near-tie")
    if not weights_compared:
        notes.append("a source holds no weights: weights not compared")
    if not token_measures:
        notes.append("layers hold different steps: per-token measures (share differing, first layer) not given")
    if b.layer_map and any(x != y for x, y in b.layer_map.items()):
        pairs = [f"{x}-{y}" for x, y in b.layer_map.items()]
        notes.append(f"layers paired by order, A's-B's: {', '.join(pairs[:6])}{' ...' if len(pairs) > 6 else ''} "
                     "(numbered as A's)")
    for s in (a, b):
        if kernels[s.label] is not None and not routed[s.label]:
            flag = "--kernel-b" if s.label == "B" and kernel_b is not None else "--kernel"
            notes.append(f"{flag} {names[s.label]} routes logits alone; {s.label} ({s.kind}) records its routing, "
                         "compared as recorded")
    return DiffResult(
        source_a=str(a.path), source_b=str(b.path), holds_a=_holds(a, units, kernels["A"]),
        holds_b=_holds(b, units, kernels["B"]), num_experts=max(a.num_experts, b.num_experts), topk=K, align=align,
        kernel=names["A"], kernel_b=None if kernel_b is None else kernel_b[0], tie_ulps=tie_ulps,
        weight_ulps=weight_ulps, ignore_ties=ignore_ties, ignore_order=ignore_order, max_flip_rate=max_flip_rate,
        layers=[per_layer[k] for k in sorted(per_layer)], ties_judged=ties_judged,
        weights_compared=weights_compared, tokens=tokens if token_measures else None,
        tokens_differing=tokens_differing if token_measures else None, examples=examples, notes=notes,
        partial=a.partial() + b.partial(), margins=margins, first_tokens=first_tokens)


def _where(offsets: list[int], requests, row: int) -> tuple[int, int, str | None, int | None]:
    """``(step, row in step, request, position)`` of A's layer row ``row`` (the last two None
    unless ``requests``, A's :meth:`Source.requests`)."""
    step = bisect.bisect_right(offsets, row) - 1
    if requests is None:
        return step, row - offsets[step], None, None
    labels, _, positions = requests
    return step, row - offsets[step], labels[step], int(positions[row])


def _holds(s: Source, units, kernel) -> str:
    kinds = sorted({s.holds(r, layer, kernel is not None) for r, layer in units})
    what = {"recorded": "recorded ids",
            "logits": f"logits routed by {kernel[0] if kernel and kernel[1] is not None else 'the reference'}"}
    return f"{s.kind}: " + " and ".join(what[k] for k in kinds)
