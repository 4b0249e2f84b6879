"""One streaming pipeline over a trace: bounded pieces of consecutive captured steps, read ahead.

Replay, validate-on-trace and balance all read a layer the same way: :func:`stream_layer`
cuts the layer's rows into chunks of at most ``budget_bytes`` of ``[rows, E]`` float32 scores,
reads the next chunk on a background thread while the caller works on this one, and moves each
chunk to the device in one copy. Consecutive steps that fit are one chunk; a step larger than
the budget is read in pieces of at most the budget (:func:`plan_rows`), so per-row work holds
bounded memory whatever a step's size. A chunk knows where it lies in its steps
(:attr:`Chunk.step_start`, :attr:`Chunk.ends_step`), so per-step figures (balancedness,
capacity, phases) accumulate over a step's pieces and are computed when its last piece is in.

Only the kernel under test needs a step whole: it must see the captured batch shape. With
``whole_steps`` the chunks hold whole steps (a step larger than the budget is a chunk of its
own), the caller runs the kernel once per captured step on that step's own rows
(:meth:`routetool.engine.router.Router.route`, one input guard for the whole chunk), and then does everything else
(the reference, the comparison, padding and validity checks, histograms, EP and capacity
statistics) over :meth:`Chunk.pieces` of at most the budget, on the device, with no host
synchronisation per step. A step is given to the kernel whole up to :data:`KERNEL_STEP_BYTES`;
a larger one (no real forward pass routes so many tokens: a damaged ``step_offsets``, or a
sparse file that declares gigabytes of logits) is refused before anything reads it
(:func:`check_steps`): one line, exit 2, naming the way that reads it in pieces (the reference).

At most two chunks are held at a time (the one in use and the one being read), so memory is
bounded by about twice the chunk plus one piece's temporaries, whatever the trace's size.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from routetool.engine.contract import KernelOutcome
from routetool.io.limits import CHUNK_BYTES

DEFAULT_CHUNK_BYTES = CHUNK_BYTES
"""Bytes of ``[rows, E]`` float32 scores per chunk and per piece of per-row work (the largest of
the comparison's temporaries): 64 MiB. A step larger than this is read in pieces."""

KERNEL_STEP_BYTES = 16 * DEFAULT_CHUNK_BYTES
"""Largest step (its rows as ``[rows, E]`` float32 scores) given whole to a kernel under test:
1 GiB, 262,144 tokens of 1,024 experts, four times a 65,536-token prefill step of 896 experts
(224 MiB) and far above the batched-token limits engines are given (vLLM's and SGLang's are
8,192 to 65,536). A kernel call holds the step's logits and its ``[rows, K]`` outputs; the
work after it runs over pieces of :data:`DEFAULT_CHUNK_BYTES`, so a command that runs a kernel
peaks at about the step plus a few chunks. Work without a kernel (``balance --reference``, the
recorded ids of an ids-only layer) reads any step in pieces and has no such bound."""


def chunk_budget(budget_bytes: int | None = None) -> int:
    """``budget_bytes``, or :data:`DEFAULT_CHUNK_BYTES` as it is when called."""
    return DEFAULT_CHUNK_BYTES if budget_bytes is None else budget_bytes


def step_bytes(trace, layer: int) -> int:
    """Bytes of one row of ``layer`` as the pipeline holds it: ``4 * E`` float32 scores, or
    ``8 * K`` int64 ids for an ids-only layer."""
    router = trace.meta.router
    return 4 * max(router.num_experts, 1) if trace.info(layer).has_logits else 8 * max(router.topk, 1)


def check_step_sizes(sizes, row_bytes: int, what: str, *, path, tensor: str | None = None, fix: str = "",
                     limit: int | None = None) -> None:
    """Refuse steps of ``sizes`` rows (``row_bytes`` a row, ``what`` they hold, in words) of which
    one is larger than ``limit`` bytes (:data:`KERNEL_STEP_BYTES`): the largest step a kernel
    under test is given whole.

    Raises:
        RouteToolError: naming ``path``, ``tensor``, the first largest step, its rows and bytes (exit 2).
    """
    from routetool.errors import RouteToolError
    from routetool.io.limits import fmt_bytes

    limit = KERNEL_STEP_BYTES if limit is None else limit
    sizes = list(sizes)
    if not sizes:
        return
    rows = max(sizes)
    if rows * row_bytes <= limit:
        return
    raise RouteToolError(
        f"step {sizes.index(rows)} holds {rows:,} rows, {fmt_bytes(rows * row_bytes)} of {what}, more than the "
        f"{fmt_bytes(limit)} a kernel under test is given whole", path=path, tensor=tensor, fix=fix)


def check_steps(trace, layer: int, limit: int | None = None) -> None:
    """Refuse, before anything is read, a layer with a step too large to give a kernel whole:
    more than ``limit`` bytes (:data:`KERNEL_STEP_BYTES`; rows counted by :func:`step_bytes`).
    Only the step offsets are read, so a sparse file declaring gigabytes is refused at once.

    Raises:
        RouteToolError: naming the trace, the layer's tensor, the step, its rows and bytes, and
            the reference as the way that reads any step (exit 2).
    """
    offsets = trace.info(layer).step_offsets
    logits = trace.info(layer).has_logits
    E = trace.meta.router.num_experts
    check_step_sizes([b - a for a, b in zip(offsets, offsets[1:])], step_bytes(trace, layer),
                     f"{E:,} experts' float32 scores" if logits else "their ids", path=trace.display_path,
                     tensor=f"layers.{layer}.{'gating_output' if logits else 'topk_ids'}", limit=limit,
                     fix="route it with the reference, which reads any step in pieces (`routetool balance "
                         "--reference`), or check the layer's step_offsets")


@dataclass
class Chunk:
    """Consecutive captured steps of one layer, or a piece of one step, on the analysis device.

    Attributes:
        layer: the layer. first_step: index of the chunk's first step in the layer.
        start: the layer row of the chunk's first row.
        offsets: step boundaries within the chunk, ``[0, n_0, n_0 + n_1, ..., rows]``.
        gating_output: ``[rows, E]`` logits as stored, or None (an ids-only layer).
        is_padding: ``[rows]`` bool or None. recorded_ids / recorded_weights: ``[rows, K]`` or None.
        step_start: rows of the first step that lie before the chunk (0 when the chunk starts
            its first step; more when it is a later piece of a step larger than the budget).
        ends_step: whether the chunk's last row ends its last step (False for a piece of a step
            whose later rows come in the next chunk). A chunk of whole steps has
            ``step_start == 0`` and ``ends_step``; a piece is one step's rows, ``num_steps == 1``.
    """

    layer: int
    first_step: int
    start: int
    offsets: list[int]
    gating_output: torch.Tensor | None
    is_padding: torch.Tensor | None
    recorded_ids: torch.Tensor | None
    recorded_weights: torch.Tensor | None
    step_start: int = 0
    ends_step: bool = True

    @property
    def whole(self) -> bool:
        """Whether the chunk holds whole steps (not a piece of one)."""
        return self.step_start == 0 and self.ends_step

    @property
    def rows(self) -> int:
        return self.offsets[-1]

    @property
    def num_steps(self) -> int:
        return len(self.offsets) - 1

    @property
    def step_sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.offsets, self.offsets[1:])]

    def step_of(self, row: int) -> int:
        """The layer step holding chunk row ``row``."""
        return self.first_step + bisect.bisect_right(self.offsets, row) - 1

    def step_index(self) -> torch.Tensor:
        """``[rows]`` int64: each row's step within the chunk (0 .. num_steps - 1), on the chunk's device."""
        device = (self.gating_output if self.gating_output is not None else self.recorded_ids).device
        sizes = torch.tensor(self.step_sizes, dtype=torch.int64, device=device)
        return torch.repeat_interleave(torch.arange(self.num_steps, device=device), sizes, output_size=self.rows)


    def pieces(self, budget_bytes: int | None = None) -> Iterator[Chunk]:
        """The chunk in pieces of at most ``budget_bytes`` of ``[rows, E]`` float32 scores (``[rows,
        K]`` int64 ids for an ids-only chunk), as :func:`plan_rows` cuts them: views, for the
        per-row work after a kernel has routed the chunk's whole steps. A chunk within the budget
        is its own one piece. Rows of a piece are ``chunk rows [piece.start - chunk.start, ...)``."""
        t = self.gating_output if self.gating_output is not None else self.recorded_ids
        row = 4 * max(t.shape[1], 1) if self.gating_output is not None else 8 * max(t.shape[1], 1)
        ranges = plan_rows(self.offsets, max(1, chunk_budget(budget_bytes) // row))
        if len(ranges) == 1:
            yield self
            return
        for a, b in ranges:
            yield _view(self, a, b)

    def rows_of(self, piece: Chunk, t: torch.Tensor | None) -> torch.Tensor | None:
        """The rows of ``t`` (``[rows, ...]``, aligned with this chunk) that ``piece`` holds."""
        a = piece.start - self.start
        return None if t is None else t[a:a + piece.rows]


def _cut(t: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
    return None if t is None else t[a:b]


def _view(chunk: Chunk, a: int, b: int) -> Chunk:
    """Rows ``[a, b)`` of ``chunk`` (cut at its step offsets or inside one step) as a chunk of views."""
    o = chunk.offsets
    s = bisect.bisect_right(o, a) - 1  # the chunk step holding row a
    e = bisect.bisect_left(o, b)  # the first offset at or past b
    inner = [v - a for v in o[s + 1:e]]
    step_start = a - o[s] + (chunk.step_start if s == 0 else 0)
    ends_step = e < len(o) and o[e] == b and (chunk.ends_step or b < o[-1])
    return Chunk(layer=chunk.layer, first_step=chunk.first_step + s, start=chunk.start + a, offsets=[0, *inner, b - a],
                 gating_output=_cut(chunk.gating_output, a, b), is_padding=_cut(chunk.is_padding, a, b),
                 recorded_ids=_cut(chunk.recorded_ids, a, b), recorded_weights=_cut(chunk.recorded_weights, a, b),
                 step_start=step_start, ends_step=ends_step)


def plan_rows(step_offsets: tuple[int, ...] | list[int], limit_rows: int) -> list[tuple[int, int]]:
    """Cut the rows of steps ``step_offsets`` (``[0, n_0, ..., rows]``) into ``[a, b)`` ranges of
    at most ``limit_rows`` rows: consecutive whole steps that fit together, and a step larger than
    that in pieces of ``limit_rows`` (the last piece the rest)."""
    limit = max(1, limit_rows)
    out: list[tuple[int, int]] = []
    num_steps = len(step_offsets) - 1
    s = 0
    while s < num_steps:
        a = step_offsets[s]
        if step_offsets[s + 1] - a > limit:
            top = step_offsets[s + 1]
            out.extend((x, min(x + limit, top)) for x in range(a, top, limit))
            s += 1
            continue
        e = s + 1
        while e < num_steps and step_offsets[e + 1] - a <= limit:
            e += 1
        out.append((a, step_offsets[e]))
        s = e
    return out


def plan_chunks(step_offsets: tuple[int, ...] | list[int], row_bytes: int, budget_bytes: int) -> list[tuple[int, int]]:
    """Group consecutive steps into chunks of at most ``budget_bytes`` (``row_bytes`` a row; at
    least one step a chunk). Returns ``(first step, end step)`` pairs, end exclusive."""
    limit = max(1, budget_bytes // max(1, row_bytes))
    plan, first = [], 0
    num_steps = len(step_offsets) - 1
    while first < num_steps:
        end = first + 1
        while end < num_steps and step_offsets[end + 1] - step_offsets[first] <= limit:
            end += 1
        plan.append((first, end))
        first = end
    return plan


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def stream_layer(trace, layer: int, device: torch.device, *, budget_bytes: int | None = None,
                 whole_steps: bool = False, read_ahead: bool = True) -> Iterator[Chunk]:
    """Yield the rows of ``layer`` in chunks (see the module docstring).

    Args:
        trace: an open trace (:func:`routetool.io.trace.open_trace`). layer: one of its layers.
        device: where the chunks go. budget_bytes: bytes of a chunk's rows (``[rows, E]`` float32
            scores, or ``[rows, K]`` int64 ids for an ids-only layer); default
            :data:`DEFAULT_CHUNK_BYTES`, read when called.
        whole_steps: chunks of whole steps, for a kernel under test (a step larger than the budget
            is a chunk of its own, up to :data:`KERNEL_STEP_BYTES`); otherwise a step larger than
            the budget comes in pieces (:attr:`Chunk.step_start`, :attr:`Chunk.ends_step`).
        read_ahead: read the next chunk on a background thread while this one is used.

    Raises:
        RouteToolError: with ``whole_steps``, a step larger than :data:`KERNEL_STEP_BYTES`
            (:func:`check_steps`, before anything is read); the trace cannot be read (raised where
            the chunk is taken).
    """
    budget_bytes = chunk_budget(budget_bytes)
    if whole_steps:
        check_steps(trace, layer)
    offsets = trace.info(layer).step_offsets
    row = step_bytes(trace, layer)
    if whole_steps:
        plan = [(offsets[f], offsets[e]) for f, e in plan_chunks(offsets, row, budget_bytes)]
    else:
        plan = plan_rows(offsets, max(1, budget_bytes // row))
    whole = Chunk(layer=layer, first_step=0, start=0, offsets=list(offsets), gating_output=None, is_padding=None,
                  recorded_ids=None, recorded_weights=None)

    def read(a: int, b: int):
        return trace.read_rows(layer, a, b)

    def chunk(a: int, b: int, rows) -> Chunk:
        at = _view(whole, a, b)
        at.gating_output, at.is_padding = _to(rows.gating_output, device), _to(rows.is_padding, device)
        at.recorded_ids, at.recorded_weights = _to(rows.recorded_ids, device), _to(rows.recorded_weights, device)
        return at

    if not read_ahead or len(plan) < 2:
        for a, b in plan:
            yield chunk(a, b, read(a, b))
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="routetool-read") as pool:
        pending = pool.submit(read, *plan[0])
        for i, (a, b) in enumerate(plan):
            rows = pending.result()
            if i + 1 < len(plan):
                pending = pool.submit(read, *plan[i + 1])
            yield chunk(a, b, rows)


@dataclass
class ChunkRouting:
    """The kernel's outputs for a chunk, step by step concatenated, or the first failed call.

    Attributes:
        weights / ids: ``[rows, K]`` (None when a call failed).
        outcome: the failed call's :class:`~routetool.engine.contract.KernelOutcome`, or None.
        step: the layer step of the failed call (for ``modified_input`` of the bias, the chunk's
            first step, as the guard cannot tell which call wrote it).
        calls: how many kernel calls were made.
    """

    weights: torch.Tensor | None
    ids: torch.Tensor | None
    outcome: KernelOutcome | None = None
    step: int = -1
    calls: int = 0

    @property
    def ok(self) -> bool:
        return self.outcome is None
