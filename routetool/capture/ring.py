"""The recorder's device ring: a graph-safe copy of every routing call, drained by the host.

What it is for: a routing call that runs as part of a CUDA-graph replay, or inside code that
torch.compile compiled, never reaches a Python wrapper. What does reach the GPU on every replay
is the work that was captured, so the recorded copy of a call is device work: the custom op
``torch.ops.routetool.record_routing`` (registered here with :mod:`torch.library`, so
torch.compile keeps it as one opaque call, in order) launches one kernel that

1. reads the ring's state words (a few int64 in device memory), decides on the device whether
   the call starts a new forward step, whether that step is sampled, and where its rows go;
2. copies the call's ``gating_output`` rows and its bias, ``is_padding``,
   ``topk_ids``/``topk_weights`` into the step's rows of the ring, and its layer position and
   the number of its router parameters (``site``) into the step's call table;
3. advances the state words (the last of the kernel's programs to finish does this).

The host compares each call's bias with its layer's first when it drains (a trace holds one
bias per layer).

No host sync and no Python run per call: CUDA-graph capture records the launch, and every
replay repeats the decision and the copy with the replay's data. On the CPU the same op runs
:func:`_record_cpu`, the same algorithm in torch, eagerly.

Memory layout (one ``uint8`` buffer of ``ring_bytes``, allocated once):

=================  ===================  ==========================================================
region             shape, dtype          meaning
=================  ===================  ==========================================================
state              [32] int64            counters and the current step (``STATE_*`` below)
steps              [S, 8] int64          per step slot: first row, rows, step number, calls,
                                         steps dropped before it, flags (interrupted, mismatched:
                                         never written)
calls              [S, L, 4] int32       per call of a step: layer position, site, has padding, tag
seen               [L] int64             per layer position: the step it was last called in (+1)
gating / ids /     [R, E] / [R, K] /     the rows: a step of ``n`` rows and ``c`` calls takes
weights / padding  [R, K] / [R] uint8    ``c * (n + b)`` consecutive rows (never split at the
                                         end); each call's ``n`` rows are followed by ``b`` rows
                                         of logits' dtype that hold its bias (:func:`bias_rows`)
=================  ===================  ==========================================================

``S`` = ``ring_steps`` step slots, ``L`` = ``max_layers`` layer positions, ``R`` rows: what the
buffer has left after the rest. Rows and step slots are counted *virtually* (they only grow);
the physical row is the virtual one modulo ``R``. The device claims, the host releases: a new
sampled step is given rows only if ``calls x n`` rows fit between the claimed end and the
released start and a step slot is free; otherwise the whole step is **dropped and counted**
(``dropped_full``; ``dropped_large`` for a step larger than the ring), never written over rows
the host has not copied yet.

Draining (:meth:`DeviceRing.snapshot`, :meth:`DeviceRing.copy_out`) is host work in stream
order, on the thread that runs the model and only while no graph is being captured: a copy of
the state words into pinned memory; once that copy has landed (an event, polled), copies of the
complete steps' rows, and the release of their rows, enqueued on the same stream, so the
release reaches the device after the copies. No other thread makes a CUDA call, so a drain
never disturbs another thread's graph capture.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from dataclasses import dataclass

import torch

from routetool_kernels.spec import schema_arguments
from routetool.capture.ring_layout import (  # noqa: F401 - the layout's names, imported from here by callers
    CALL_WIDTH, MISMATCH_CALLS, MISMATCH_ROWS, RingLayout, STATE_CALLS_DROPPED, STATE_CALLS_IN_STEP,
    STATE_CALLS_RECORDED, STATE_CALLS_SEEN, STATE_CUR_ROW, STATE_CUR_ROWS, STATE_CUR_SLOT, STATE_DONE,
    STATE_DROPPED_FULL, STATE_DROPPED_LARGE, STATE_HEAD_ROWS, STATE_HEAD_STEPS, STATE_HOST_STOP,
    STATE_LAST_STEP_CALLS, STATE_LEN, STATE_MISMATCH_CALLS, STATE_MISMATCH_KIND, STATE_MISMATCH_ROWS,
    STATE_MISMATCH_STEP, STATE_MISMATCH_STEP_ROWS, STATE_RELEASED_ROWS, STATE_RELEASED_STEPS, STATE_STEPS_SEEN,
    STATE_STOPPED, STATE_TOKENS, STEP_CALLS, STEP_DROPS_BEFORE, STEP_FLAGS, STEP_INTERRUPTED, STEP_MISMATCHED,
    STEP_NUMBER, STEP_ROW, STEP_ROWS, STEP_WIDTH, STOPPED_BUDGET, STOPPED_MISMATCH, bias_rows, call_tag,
    header_layout, join_bias, split_bias, _ALIGN, _TAG_MOD, _align,
)


@dataclass
class RingCall:
    """One recorded routing call, copied to the host (CPU tensors)."""

    position: int
    site: int
    gating: torch.Tensor
    bias: torch.Tensor  # [E] float32
    padding: torch.Tensor | None
    ids: torch.Tensor | None
    weights: torch.Tensor | None


@dataclass
class RingStep:
    """One recorded forward step: its number (counting every step seen), rows, calls."""

    number: int
    num_tokens: int
    drops_before: int
    calls: list[RingCall]
    flags: int = 0  # STEP_INTERRUPTED / STEP_MISMATCHED: a step that must not be written


@dataclass
class RingCopy:
    """Host copies of drained steps, in flight until ``event`` (None on the CPU) completes."""

    steps: torch.Tensor  # [n, STEP_WIDTH] int64: the drained step slots
    first_slot: int  # virtual slot of steps[0]
    calls: torch.Tensor  # [n, L, CALL_WIDTH] int32
    first_row: int  # virtual row of the rows' first entry
    rows_end: int
    rows: dict[str, torch.Tensor]  # gating, padding, ids, weights: virtual rows [first_row, rows_end)
    event: object = None
    state: list[int] | None = None  # the state words the copy was made from
    taken: bool = False  # the writer took it (a copy handed over twice is taken once)

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


@dataclass
class RingSnapshot:
    """The state words as of a point in stream order (pinned host copy), ready when ``event`` is."""

    state: torch.Tensor
    event: object = None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def values(self) -> list[int]:
        return self.state.tolist()


_HANDLES = itertools.count(1)
_HANDLES_LOCK = threading.Lock()


class DeviceRing:
    """A preallocated ring buffer on one device that the record op writes into.

    Args:
        ring_bytes: the whole buffer's size (header, bias and rows).
        steps: step slots (at most this many recorded steps wait for the host at a time).
        max_layers: layer positions (at most this many calls per step are recorded).
        num_layers: calls per forward step (0: unknown; steps end on a repeated layer or
            :meth:`end_step`).
        skip_steps / every_n_steps / max_tokens: sampling, decided on the device (step numbers
            count every step seen; ``max_tokens`` -1 means no budget).
        record_outputs: also keep ``topk_ids``/``topk_weights``.
        device: where the buffer lives (the device of the recorded calls).

    The buffer is allocated here, outside any graph capture; only the header is zeroed.
    """

    def __init__(self, *, ring_bytes: int, steps: int, max_layers: int, num_layers: int, skip_steps: int,
                 every_n_steps: int, max_tokens: int, record_outputs: bool, device: torch.device):
        self.layout = header_layout(ring_bytes, steps, max_layers)
        if self.layout.header_bytes >= ring_bytes:
            raise ValueError(f"a ring of {ring_bytes} bytes has no room for its header of {self.layout.header_bytes} "
                             f"bytes ({steps} step slots x {max_layers} layers)")
        self.device = torch.device(device)
        self.num_layers = num_layers
        self.skip_steps = skip_steps
        self.every_n_steps = every_n_steps
        self.max_tokens = max_tokens
        self.record_outputs = record_outputs
        self.buf = torch.empty(ring_bytes, dtype=torch.uint8, device=self.device)
        self.buf[: self.layout.header_bytes].zero_()
        self.state = self.buf[: STATE_LEN * 8].view(torch.int64)
        lay = self.layout
        self.steps_table = self._view(lay.off_steps, (steps, STEP_WIDTH), torch.int64)
        self.calls_table = self._view(lay.off_calls, (steps, max_layers, CALL_WIDTH), torch.int32)
        self.seen = self._view(lay.off_seen, (max_layers,), torch.int64)
        self.rows_per_program: int | None = None  # the record kernel's rows per program (None: its default)
        self.num_warps = 4
        self.use_pdl: bool | None = None  # programmatic dependent launch (None: where supported)
        self.plans: dict = {}  # the recorder's launch plans by call signature (routetool.capture.recorder)
        if self.device.type == "cuda":
            self.end_step()  # compiles the end-of-step kernel now, never inside a graph capture (no step yet: a no-op)

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        return self.buf[offset: offset + numel * dtype.itemsize].view(dtype).view(shape)

    # -- binding the data layout (host only, at the first call) -------------------------------
    def bind(self, num_experts: int, topk: int, gating_dtype: torch.dtype, weights_dtype: torch.dtype) -> None:
        """Carve the row regions for calls of ``num_experts`` x ``topk``.

        Raises:
            ValueError: the buffer leaves no room for a single row.
        """
        lay = self.layout
        probe = RingLayout(**{**lay.__dict__, "num_experts": num_experts, "topk": topk, "gating_dtype": gating_dtype,
                              "weights_dtype": weights_dtype, "record_outputs": self.record_outputs})
        slack = 5 * _ALIGN
        rows = (lay.ring_bytes - lay.header_bytes - slack) // probe.row_bytes()
        if rows < 2 + bias_rows(gating_dtype):
            need = lay.header_bytes + slack + probe.row_bytes() * (2 + bias_rows(gating_dtype))
            raise ValueError(f"a ring of {lay.ring_bytes} bytes has no room for rows of {num_experts} experts "
                             f"(it needs at least {need} bytes)")
        off_gating = lay.header_bytes
        off_ids = _align(off_gating + rows * num_experts * gating_dtype.itemsize)
        off_weights = _align(off_ids + (rows * topk * 4 if self.record_outputs else 0))
        off_padding = _align(off_weights + (rows * topk * weights_dtype.itemsize if self.record_outputs else 0))
        assert off_padding + rows <= lay.ring_bytes
        self.layout = RingLayout(**{**probe.__dict__, "rows": rows, "off_gating": off_gating,
                                    "off_ids": off_ids, "off_weights": off_weights, "off_padding": off_padding})
        self.gating = self._view(off_gating, (rows, num_experts), gating_dtype)
        self.padding = self._view(off_padding, (rows,), torch.uint8)
        if self.record_outputs:
            self.ids = self._view(off_ids, (rows, topk), torch.int32)
            self.weights = self._view(off_weights, (rows, topk), weights_dtype)

    # -- the device side ------------------------------------------------------------------------
    def launch(self, gating: torch.Tensor, bias: torch.Tensor, padding: torch.Tensor | None,
               weights: torch.Tensor | None, ids: torch.Tensor | None, position: int, site: int) -> object:
        """Record one call (device work on the current stream; eager torch on the CPU).

        Returns the kernel's launch (:func:`routetool.capture.ring_kernel.record_routing_call`),
        which later calls of the same signature may repeat directly; None on the CPU."""
        if not self.record_outputs:
            weights = ids = None
        if self.device.type == "cpu":
            _record_cpu(self, gating, bias, padding, weights, ids, position, site)
            return None
        from routetool.capture.ring_kernel import record_routing_call  # (imports Triton: only on a GPU)

        return record_routing_call(self, gating, bias, padding, weights, ids, position, site)

    def end_step(self, interrupted: bool = False) -> None:
        """End the current forward step (stream-ordered: also inside a captured graph).

        A step that ends after a number of calls that is not a whole number of ``num_layers`` is
        flagged (never written); unless ``interrupted`` (the run stopped inside the step), it is
        also the recording's first disagreeing step: recording stops and the state words say
        which step and how many calls (``STATE_MISMATCH_*``)."""
        if self.device.type == "cpu":
            _end_step_cpu(self, interrupted)
        else:
            from routetool.capture.ring_kernel import end_step_call

            end_step_call(self, interrupted)

    def stop(self) -> None:
        """Stop recording on the device (stream-ordered); later launches only count calls."""
        self.state[STATE_HOST_STOP].fill_(1)

    def restart(self) -> None:
        """Record again after :meth:`stop`, numbering steps from 0 (stream-ordered)."""
        self.state[STATE_STEPS_SEEN: STATE_CALLS_IN_STEP + 1].zero_()
        self.seen.zero_()
        self.state[STATE_HOST_STOP].zero_()

    # -- the host side: draining --------------------------------------------------------------
    def snapshot(self) -> RingSnapshot:
        """The state words, copied in stream order (not while the current stream captures)."""
        if self.device.type == "cpu":
            return RingSnapshot(self.state.clone())
        host = torch.empty(STATE_LEN, dtype=torch.int64, pin_memory=True)
        host.copy_(self.state, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return RingSnapshot(host, event)

    def complete_steps(self, state: list[int], released_steps: int, final: bool) -> int:
        """The end of the steps that are complete in ``state`` (the current step counts once a
        later step began, or when it has ``num_layers`` calls, or at the end)."""
        end = state[STATE_HEAD_STEPS]
        if final or end <= released_steps:
            return end
        current = state[STATE_CUR_SLOT] - 1
        in_progress = current == end - 1 and (self.num_layers == 0 or state[STATE_CALLS_IN_STEP] < self.num_layers)
        return end - 1 if in_progress else end

    def copy_out(self, state: list[int], released_rows: int, released_steps: int, final: bool,
                 release: bool = True) -> RingCopy | None:
        """Copy the complete steps after ``released_steps`` to the host and release their rows.

        Enqueued on the current stream: the copies (into pinned memory, non-blocking), then the
        release of the rows and step slots they read, so the device reuses them only after the
        copies. Returns None when no step is complete. ``release=False``: the caller releases
        (:meth:`release`, with the copy's ``rows_end`` and ``first_slot + len(steps)``) once it
        has taken the copy over, so that an interruption in between loses no step.
        """
        lay = self.layout
        end = self.complete_steps(state, released_steps, final)
        if end <= released_steps or not lay.bound:
            return None
        # the rows of the drained steps: from the released row to where the next claimed step
        # starts (the current step, when it is left for later) or to the claimed end
        rows_end = state[STATE_HEAD_ROWS] if end == state[STATE_HEAD_STEPS] else state[STATE_CUR_ROW]
        steps = self._copy_ring(self.steps_table, released_steps, end)
        calls = self._copy_ring(self.calls_table, released_steps, end)
        rows = {name: self._copy_ring(getattr(self, name), released_rows, rows_end)
                for name in ("gating", "padding") + (("ids", "weights") if self.record_outputs else ())}
        event = None
        if self.device.type != "cpu":
            event = torch.cuda.Event()
            event.record()
        if release:
            self.release(rows_end, end)
        return RingCopy(steps=steps, first_slot=released_steps, calls=calls, first_row=released_rows,
                        rows_end=rows_end, rows=rows, event=event)

    def decode(self, copy: RingCopy) -> list[RingStep]:
        """The steps of a landed :class:`RingCopy` (host work, any thread)."""
        steps_out = []
        L = self.layout.max_layers
        b = bias_rows(self.layout.gating_dtype)
        rows = copy.rows
        available = copy.rows_end - copy.first_row
        for i, (row0, n, number, ncalls, drops, flags) in enumerate(t[:6] for t in copy.steps.tolist()):
            tag = call_tag(copy.first_slot + i)
            calls = []
            for j, (pos, site, has_pad, entry_tag) in enumerate(copy.calls[i, : min(ncalls, L)].tolist()):
                if entry_tag != tag:  # not written in this step (a call of other rows, or no room)
                    continue
                r = row0 - copy.first_row + j * (n + b)
                if r + n + b > available:  # a call whose state words were never committed (an interrupt)
                    continue
                calls.append(RingCall(
                    position=pos, site=site, gating=rows["gating"][r: r + n],
                    bias=join_bias(rows["gating"][r + n: r + n + b]),
                    padding=rows["padding"][r: r + n].bool() if has_pad else None,
                    ids=rows["ids"][r: r + n] if "ids" in rows else None,
                    weights=rows["weights"][r: r + n] if "weights" in rows else None,
                ))
            steps_out.append(RingStep(number=number, num_tokens=n, drops_before=drops, calls=calls, flags=flags))
        return steps_out

    def _copy_ring(self, ring: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """Host copy of virtual entries ``[first, end)`` of a circular table (``end - first``
        at most its length): one or two slices."""
        size = ring.shape[0]
        n = end - first
        start = first % size
        pieces = [(start, min(size, start + n))]
        if start + n > size:
            pieces.append((0, start + n - size))
        if self.device.type == "cpu":
            return torch.cat([ring[a:b] for a, b in pieces])
        host = torch.empty((n, *ring.shape[1:]), dtype=ring.dtype, pin_memory=True)
        at = 0
        for a, b in pieces:
            host[at: at + b - a].copy_(ring[a:b], non_blocking=True)
            at += b - a
        return host

    def release(self, rows: int, steps: int) -> None:
        """Let the device reuse virtual rows below ``rows`` and step slots below ``steps``
        (stream-ordered, after the copies enqueued before)."""
        if self.device.type == "cpu":
            self.state[STATE_RELEASED_ROWS] = rows
            self.state[STATE_RELEASED_STEPS] = steps
            return
        src = torch.tensor([rows, steps], dtype=torch.int64).pin_memory()
        self.state[STATE_RELEASED_ROWS: STATE_RELEASED_STEPS + 1].copy_(src, non_blocking=True)


# -- the CPU implementation ---------------------------------------------------------------------
def _record_cpu(ring: DeviceRing, gating: torch.Tensor, bias: torch.Tensor, padding: torch.Tensor | None,
                weights: torch.Tensor | None, ids: torch.Tensor | None, position: int, site: int) -> None:
    """The record kernel's algorithm (:mod:`routetool.capture.ring_kernel`) in torch, for the CPU:
    the same decisions, state words, tables and rows."""
    lay = ring.layout
    s = ring.state.tolist()
    n = int(gating.shape[0])
    L, R, S = ring.num_layers, lay.rows, lay.steps
    b = bias_rows(lay.gating_dtype)
    calls_in_step = s[STATE_CALLS_IN_STEP]
    explicit = position >= 0
    pos = position if explicit else (0 if calls_in_step >= L else calls_in_step)
    steps_seen = s[STATE_STEPS_SEEN]
    new_step = (calls_in_step == 0 or (L > 0 and calls_in_step >= L)
                or (explicit and int(ring.seen[pos]) == steps_seen))
    steps_seen_new = steps_seen + int(new_step)
    number = steps_seen_new - 1
    j = 0 if new_step else calls_in_step
    rel = number - ring.skip_steps
    running = s[STATE_STOPPED] == 0 and s[STATE_HOST_STOP] == 0
    sampled = new_step and rel >= 0 and rel % ring.every_n_steps == 0 and running and n > 0
    over_budget = sampled and ring.max_tokens >= 0 and s[STATE_TOKENS] + n > ring.max_tokens
    sampled = sampled and not over_budget
    expect = L if L > 0 else max(s[STATE_LAST_STEP_CALLS], 1)
    reserve = (n + b) * expect
    too_large = sampled and reserve > R
    head_rows = s[STATE_HEAD_ROWS]
    phys = head_rows % R
    start = head_rows - phys + R if phys + reserve > R else head_rows
    full = sampled and not too_large and (start + reserve - s[STATE_RELEASED_ROWS] > R
                                          or s[STATE_HEAD_STEPS] - s[STATE_RELEASED_STEPS] >= S)
    claim = sampled and not too_large and not full
    slot = s[STATE_HEAD_STEPS] if claim else (-1 if new_step else s[STATE_CUR_SLOT] - 1)
    row0 = start if claim else s[STATE_CUR_ROW]
    rows = n if new_step else s[STATE_CUR_ROWS]
    other_rows = not new_step and n != rows and running and rel >= 0
    refuse = other_rows and s[STATE_MISMATCH_STEP] == 0
    stride = rows + b
    active = slot >= 0
    end = row0 + (j + 1) * stride
    write = (active and not other_rows and n == rows and j < lay.max_layers and row0 % R + (j + 1) * stride <= R
             and end - s[STATE_RELEASED_ROWS] <= R)
    if write:
        dst = row0 % R + j * stride
        ring.gating[dst: dst + n] = gating
        ring.gating[dst + n: dst + n + b] = split_bias(bias, lay.gating_dtype)
        if padding is not None:
            ring.padding[dst: dst + n] = padding.to(torch.uint8)
        if ids is not None:
            ring.ids[dst: dst + n] = ids.to(torch.int32)
            ring.weights[dst: dst + n] = weights.to(ring.weights.dtype)
        ring.calls_table[slot % S, j] = torch.tensor([pos, site, int(padding is not None), call_tag(slot)],
                                                     dtype=torch.int32)
    new = dict(enumerate(s))
    new[STATE_CALLS_SEEN] += 1
    new[STATE_STEPS_SEEN] = steps_seen_new
    new[STATE_CALLS_IN_STEP] = j + 1
    if new_step and calls_in_step > 0:
        new[STATE_LAST_STEP_CALLS] = calls_in_step
    new[STATE_CUR_SLOT] = slot + 1
    new[STATE_CUR_ROW] = row0
    new[STATE_CUR_ROWS] = rows
    head = start if claim else head_rows
    new[STATE_HEAD_ROWS] = max(head, end) if write else head
    new[STATE_HEAD_STEPS] += int(claim)
    new[STATE_TOKENS] += n if claim else 0
    new[STATE_CALLS_RECORDED] += int(write)
    new[STATE_DROPPED_FULL] += int(full)
    new[STATE_DROPPED_LARGE] += int(too_large)
    new[STATE_CALLS_DROPPED] += int(active and not write and n > 0)
    if over_budget:
        new[STATE_STOPPED] = STOPPED_BUDGET
    elif refuse:
        new[STATE_STOPPED] = STOPPED_MISMATCH
        new[STATE_MISMATCH_STEP] = steps_seen_new
        new[STATE_MISMATCH_KIND] = MISMATCH_ROWS
        new[STATE_MISMATCH_CALLS] = j + 1
        new[STATE_MISMATCH_ROWS] = n
        new[STATE_MISMATCH_STEP_ROWS] = rows
    # the step's table entry first, the state words last: a KeyboardInterrupt between two of these
    # statements leaves a state that never points at an entry or rows not yet written
    if claim:
        ring.steps_table[slot % S] = torch.tensor(
            [start, n, number, 0, s[STATE_DROPPED_FULL] + s[STATE_DROPPED_LARGE], 0, 0, 0], dtype=torch.int64)
    if write:
        ring.steps_table[slot % S, STEP_CALLS] = j + 1
    if active and other_rows:
        ring.steps_table[slot % S, STEP_FLAGS] = STEP_MISMATCHED
    ring.seen[pos] = steps_seen_new
    ring.state.copy_(torch.tensor([new[i] for i in range(STATE_LEN)], dtype=torch.int64))


def _end_step_cpu(ring: DeviceRing, interrupted: bool) -> None:
    """:func:`routetool.capture.ring_kernel._end_step_kernel` in torch, for the CPU."""
    s = ring.state.tolist()
    calls, slot, L = s[STATE_CALLS_IN_STEP], s[STATE_CUR_SLOT] - 1, ring.num_layers
    short = L > 0 and 0 < calls < L
    if short and slot >= 0:
        ring.steps_table[slot % ring.layout.steps, STEP_FLAGS] = STEP_INTERRUPTED if interrupted else STEP_MISMATCHED
    if (not interrupted and short and s[STATE_STOPPED] == 0 and s[STATE_HOST_STOP] == 0
            and s[STATE_STEPS_SEEN] - 1 - ring.skip_steps >= 0 and s[STATE_MISMATCH_STEP] == 0):
        ring.state[STATE_MISMATCH_STEP] = s[STATE_STEPS_SEEN]
        ring.state[STATE_MISMATCH_KIND] = MISMATCH_CALLS
        ring.state[STATE_MISMATCH_CALLS] = calls
        ring.state[STATE_STOPPED] = STOPPED_MISMATCH
    ring.state[STATE_CALLS_IN_STEP] = 0


# -- the custom op ------------------------------------------------------------------------------
_SINKS: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()


def register_sink(sink: object) -> int:
    """Register the object whose ``record_call(...)`` the op's host side calls; returns its handle
    (the op's ``handle`` argument). Held weakly: a collected sink's handle records nothing."""
    with _HANDLES_LOCK:
        handle = next(_HANDLES)
    _SINKS[handle] = sink
    return handle


def _record_routing(token: torch.Tensor, gating_output: torch.Tensor, bias: torch.Tensor,
                    is_padding: torch.Tensor | None, topk_weights: torch.Tensor | None,
                    topk_ids: torch.Tensor | None, handle: int, position: int, *router: object) -> None:
    sink = _SINKS.get(handle)
    if sink is None:
        return
    sink.record_call(token, gating_output, bias, is_padding, topk_weights, topk_ids, position, router)


record_routing = torch.library.custom_op(
    "routetool::record_routing", _record_routing, mutates_args=("token",),
    schema="(Tensor(a!) token, Tensor gating_output, Tensor bias, Tensor? is_padding, Tensor? topk_weights, "
           f"Tensor? topk_ids, int handle, int position, {schema_arguments()}) -> ()",
)
"""``torch.ops.routetool.record_routing(token, gating_output, bias, is_padding, topk_weights,
topk_ids, handle, position, *router)``: record one routing call into the ring of the recorder
``handle`` (:func:`register_sink`). ``router``: the call's router arguments in the seed's order
(:data:`routetool_kernels.spec.RouterSpec.KERNEL_KEYWORDS`, typed in the schema by
:func:`routetool_kernels.spec.schema_arguments`: ``int topk, float route_scale, ...``), as
:meth:`~routetool_kernels.spec.RouterSpec.call_values` gives them. ``position``: the call's layer
position, or -1 for its place in the step. ``token``: a tensor of the recorder's that the op is
declared to mutate, so that torch.compile keeps the call, in order, as one opaque node (the
ring itself may not exist yet when a graph is traced). CUDA-graph capture records the kernel
the op launches."""


@record_routing.register_fake
def _record_routing_fake(token, gating_output, bias, is_padding, topk_weights, topk_ids, handle, position,
                         *router) -> None:
    return None
