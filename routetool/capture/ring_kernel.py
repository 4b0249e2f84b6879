"""The record kernel: one launch copies one routing call into the recorder's device ring.

Algorithm (the ring's layout and state words: :mod:`routetool.capture.ring`). Every program
of a launch first issues all its loads at once (the state words, its block of the call's rows,
padding, ids and weights): one round trip to memory. Nothing writes the state words until
all programs are done, so all take the same decisions: does this call start a forward step (the
first call, a call after ``num_layers`` calls, a repeated layer position, or after
``end_step``), is the step sampled (``skip_steps``, ``every_n_steps``, ``max_tokens``, stopped),
is there room for the whole step (``calls x (rows + bias rows)`` consecutive rows between the
claimed end and the released start, and a free step slot), where this call's rows go, and
does the call disagree with its step (other rows than the step's first call: recording stops,
the state words keep the step, its slot is flagged so the host never writes it). Each
program stores its rows; program 0 also writes the call's table entry and its bias (as the
float32 bits, in the rows after the call's rows). The last program to finish (a ticket taken
with an atomic add; with one program, that program) writes the new state words. Launches on
one stream run one after the other, so the next call sees them; on Hopper and newer the kernel
is a programmatic dependent launch, as the routing kernels are, so that neither launch waits
for the other to be scheduled. Nothing here waits for the host: CUDA-graph capture records the
launch and every replay repeats it.

The end of a step (:func:`_end_step_kernel`, one program) is device work too: it judges the
calls since the last whole step (a whole number of ``num_layers``, or the step is flagged and,
unless the run stopped inside it, refused) and starts a new step.

The ring's layout comes from :mod:`routetool.capture.ring_layout`; the ring itself
(:class:`routetool.capture.ring.DeviceRing`, the ``ring`` argument) imports this module when it
launches, never the other way. This module imports Triton: import it lazily (after
``TRITON_INTERPRET`` is settled).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from routetool_kernels._dispatch import KernelLaunch
from routetool_kernels._launch import pdl_supported
from routetool.capture import ring_layout as R

_HEAD_ROWS = tl.constexpr(R.STATE_HEAD_ROWS)
_HEAD_STEPS = tl.constexpr(R.STATE_HEAD_STEPS)
_STEPS_SEEN = tl.constexpr(R.STATE_STEPS_SEEN)
_CALLS_IN_STEP = tl.constexpr(R.STATE_CALLS_IN_STEP)
_CUR_SLOT = tl.constexpr(R.STATE_CUR_SLOT)
_CUR_ROW = tl.constexpr(R.STATE_CUR_ROW)
_CUR_ROWS = tl.constexpr(R.STATE_CUR_ROWS)
_LAST_STEP_CALLS = tl.constexpr(R.STATE_LAST_STEP_CALLS)
_TOKENS = tl.constexpr(R.STATE_TOKENS)
_CALLS_SEEN = tl.constexpr(R.STATE_CALLS_SEEN)
_CALLS_RECORDED = tl.constexpr(R.STATE_CALLS_RECORDED)
_DROPPED_FULL = tl.constexpr(R.STATE_DROPPED_FULL)
_DROPPED_LARGE = tl.constexpr(R.STATE_DROPPED_LARGE)
_CALLS_DROPPED = tl.constexpr(R.STATE_CALLS_DROPPED)
_STOPPED = tl.constexpr(R.STATE_STOPPED)
_MISMATCH_STEP = tl.constexpr(R.STATE_MISMATCH_STEP)
_MISMATCH_KIND = tl.constexpr(R.STATE_MISMATCH_KIND)
_MISMATCH_CALLS = tl.constexpr(R.STATE_MISMATCH_CALLS)
_MISMATCH_ROWS = tl.constexpr(R.STATE_MISMATCH_ROWS)
_MISMATCH_STEP_ROWS = tl.constexpr(R.STATE_MISMATCH_STEP_ROWS)
_DONE = tl.constexpr(R.STATE_DONE)
_RELEASED_ROWS = tl.constexpr(R.STATE_RELEASED_ROWS)
_RELEASED_STEPS = tl.constexpr(R.STATE_RELEASED_STEPS)
_HOST_STOP = tl.constexpr(R.STATE_HOST_STOP)
_STOPPED_BUDGET = tl.constexpr(R.STOPPED_BUDGET)
_STOPPED_MISMATCH = tl.constexpr(R.STOPPED_MISMATCH)
_KIND_CALLS = tl.constexpr(R.MISMATCH_CALLS)
_KIND_ROWS = tl.constexpr(R.MISMATCH_ROWS)
_STEP_FLAGS = tl.constexpr(R.STEP_FLAGS)
_STEP_INTERRUPTED = tl.constexpr(R.STEP_INTERRUPTED)
_STEP_MISMATCHED = tl.constexpr(R.STEP_MISMATCHED)
_STEP_WIDTH = tl.constexpr(R.STEP_WIDTH)
_CALL_WIDTH = tl.constexpr(R.CALL_WIDTH)
_TAG_MOD = tl.constexpr(R._TAG_MOD)


@triton.jit(do_not_specialize=["num_tokens", "position", "site"])
def _record_kernel(
    gating_ptr,  # (T, E) fp32|bf16|fp16, any strides
    bias_ptr,  # (E,) fp32|bf16|fp16, any stride
    pad_ptr,  # (T,) bool, or None
    weights_ptr,  # (T, K) fp32|bf16|fp16|fp64, any strides, or None
    ids_ptr,  # (T, K) int32|int64, any strides, or None
    position,  # the call's layer position (>= 0), or -1: its place in the step
    site,  # the host's number of the call's router parameters
    state_ptr,  # (STATE_LEN,) int64: the ring's state words
    steps_ptr,  # (S, STEP_WIDTH) int64: step slots
    calls_ptr,  # (S, L, CALL_WIDTH) int32: the calls of each step slot
    seen_ptr,  # (L,) int64: the step each layer position was last called in (+1)
    g_ring_ptr,  # (R, E) the logits' dtype: rows (a call's bias follows its rows, BIAS_ROWS rows)
    i_ring_ptr,  # (R, K) int32, or None
    w_ring_ptr,  # (R, K) fp32|bf16|fp16, or None
    p_ring_ptr,  # (R,) uint8
    num_tokens,
    num_experts,
    topk,
    stride_gm,
    stride_gn,
    stride_b,
    stride_p,
    stride_wm,
    stride_wk,
    stride_im,
    stride_ik,
    ring_rows,
    ring_steps,
    max_layers,
    num_layers,  # calls per step, 0 if unknown
    skip_steps,
    every_n_steps,
    max_tokens,  # -1: no budget
    BIAS_ROWS: tl.constexpr,  # ring rows that hold a call's float32 bias: 1 (fp32 logits) or 2 (16-bit: high, low halves)
    BLOCK_R: tl.constexpr,
    SUB_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_OUTPUTS: tl.constexpr,
    SINGLE: tl.constexpr,  # one program: no ticket
    USE_PDL: tl.constexpr,
):
    """Grid ``(cdiv(max(T, 1), BLOCK_R),)``: program ``p`` copies rows ``[p * BLOCK_R, (p + 1) * BLOCK_R)``,
    ``SUB_R`` rows at a time (a tile of ``SUB_R x BLOCK_E`` logits stays in registers).

    The state words (and, for an explicit position, the position's last step) are loaded at once,
    in one round trip; nothing else is loaded before the decision."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the routing kernel's outputs and the previous call's state words
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    st = state_ptr
    n = num_tokens.to(tl.int64)
    given = position.to(tl.int64)
    explicit = given >= 0
    seen_given = tl.load(seen_ptr + tl.maximum(given, 0), mask=explicit, other=-1)
    head_rows = tl.load(st + _HEAD_ROWS)
    head_steps = tl.load(st + _HEAD_STEPS)
    steps_seen = tl.load(st + _STEPS_SEEN)
    calls_in_step = tl.load(st + _CALLS_IN_STEP)
    cur_slot = tl.load(st + _CUR_SLOT) - 1
    cur_row = tl.load(st + _CUR_ROW)
    cur_rows = tl.load(st + _CUR_ROWS)
    last_step_calls = tl.load(st + _LAST_STEP_CALLS)
    tokens = tl.load(st + _TOKENS)
    stopped = tl.load(st + _STOPPED)
    released_rows = tl.load(st + _RELEASED_ROWS)
    released_steps = tl.load(st + _RELEASED_STEPS)
    host_stop = tl.load(st + _HOST_STOP)
    calls_seen = tl.load(st + _CALLS_SEEN)
    calls_recorded = tl.load(st + _CALLS_RECORDED)
    dropped_full = tl.load(st + _DROPPED_FULL)
    dropped_large = tl.load(st + _DROPPED_LARGE)
    calls_dropped = tl.load(st + _CALLS_DROPPED)
    mismatch_step = tl.load(st + _MISMATCH_STEP)

    # the step and the call's place in it
    by_order = tl.where(calls_in_step >= num_layers, 0, calls_in_step)
    pos = tl.where(explicit, given, by_order)
    new_step = (calls_in_step == 0) | ((num_layers > 0) & (calls_in_step >= num_layers)) | (
        explicit & (seen_given == steps_seen))
    steps_seen_new = steps_seen + new_step.to(tl.int64)
    number = steps_seen_new - 1
    j = tl.where(new_step, 0, calls_in_step)
    rel = number - skip_steps
    running = (stopped == 0) & (host_stop == 0)
    sampled = new_step & (rel >= 0) & (rel % every_n_steps == 0) & running & (n > 0)
    over_budget = sampled & (max_tokens >= 0) & (tokens + n > max_tokens)
    sampled = sampled & (over_budget == 0)
    # room for the whole step: calls x (rows + bias rows) consecutive rows, and a step slot
    expect = tl.where(num_layers > 0, num_layers, tl.maximum(last_step_calls, 1))
    reserve = (n + BIAS_ROWS) * expect
    too_large = sampled & (reserve > ring_rows)
    phys = head_rows % ring_rows
    start = tl.where(phys + reserve > ring_rows, head_rows - phys + ring_rows, head_rows)
    full = sampled & (too_large == 0) & (
        (start + reserve - released_rows > ring_rows) | (head_steps - released_steps >= ring_steps))
    claim = sampled & (too_large == 0) & (full == 0)
    slot = tl.where(claim, head_steps, tl.where(new_step, -1, cur_slot))
    row0 = tl.where(claim, start, cur_row)
    rows = tl.where(new_step, n, cur_rows)  # the step's rows per call (its first call's)
    # one step's calls route the same tokens: a call of other rows means the calls are not counted into
    # the steps they belong to (judged from skip_steps on, while recording)
    other_rows = (new_step == 0) & (n != rows) & running & (rel >= 0)
    refuse = other_rows & (mismatch_step == 0)
    stride = rows + BIAS_ROWS  # ring rows per call of this step
    active = slot >= 0
    end = row0 + (j + 1) * stride
    write = active & (other_rows == 0) & (n == rows) & (j < max_layers) & ((row0 % ring_rows) + (j + 1) * stride <= ring_rows) & (
        end - released_rows <= ring_rows)
    dst_row = row0 % ring_rows + j * stride

    # the rows, padding and outputs of this program's block, SUB_R rows at a time
    limit = tl.where(write, n, 0)  # no rows unless the call is written
    for r0 in tl.static_range(0, BLOCK_R, SUB_R):
        src_r = (pid * BLOCK_R + r0 + tl.arange(0, SUB_R)).to(tl.int64)
        r_ok = src_r < limit
        dst_r = dst_row + src_r
        for c0 in range(0, num_experts, BLOCK_E):
            c = c0 + tl.arange(0, BLOCK_E)
            m = r_ok[:, None] & (c < num_experts)[None, :]
            x = tl.load(gating_ptr + src_r[:, None] * stride_gm + c[None, :] * stride_gn, mask=m)
            tl.store(g_ring_ptr + dst_r[:, None] * num_experts + c[None, :], x, mask=m)
        if HAS_PAD:
            p = tl.load(pad_ptr + src_r * stride_p, mask=r_ok, other=0)
            tl.store(p_ring_ptr + dst_r, p.to(tl.uint8), mask=r_ok)
        if HAS_OUTPUTS:
            k = tl.arange(0, BLOCK_K)
            km = r_ok[:, None] & (k < topk)[None, :]
            ids = tl.load(ids_ptr + src_r[:, None] * stride_im + k[None, :] * stride_ik, mask=km)
            tl.store(i_ring_ptr + dst_r[:, None] * topk + k[None, :], ids.to(tl.int32), mask=km)
            w = tl.load(weights_ptr + src_r[:, None] * stride_wm + k[None, :] * stride_wk, mask=km)
            tl.store(w_ring_ptr + dst_r[:, None] * topk + k[None, :], w.to(w_ring_ptr.dtype.element_ty), mask=km)

    # program 0: the call's table entry and its bias (after its rows)
    if pid == 0:
        if write:
            entry = calls_ptr + ((slot % ring_steps) * max_layers + j) * _CALL_WIDTH
            tl.store(entry, pos.to(tl.int32))
            tl.store(entry + 1, site)
            tl.store(entry + 2, 1 if HAS_PAD else 0)
            tl.store(entry + 3, (slot % _TAG_MOD + 1).to(tl.int32))
            bias_row = (dst_row + n) * num_experts
            for c0 in range(0, num_experts, BLOCK_E):
                cb = c0 + tl.arange(0, BLOCK_E)
                cm = cb < num_experts
                b = tl.load(bias_ptr + cb * stride_b, mask=cm, other=0.0).to(tl.float32)
                if BIAS_ROWS == 1:
                    tl.store(g_ring_ptr + bias_row + cb, b.to(g_ring_ptr.dtype.element_ty), mask=cm)
                else:  # 16-bit rows: the float32 bits' high halves, then the low halves
                    bits = b.to(tl.int32, bitcast=True)
                    hi = (bits >> 16).to(tl.int16).to(g_ring_ptr.dtype.element_ty, bitcast=True)
                    lo = (bits & 0xFFFF).to(tl.int16).to(g_ring_ptr.dtype.element_ty, bitcast=True)
                    tl.store(g_ring_ptr + bias_row + cb, hi, mask=cm)
                    tl.store(g_ring_ptr + bias_row + num_experts + cb, lo, mask=cm)

    # the last program: the new state words
    if SINGLE:
        last = pid == 0
    else:
        ticket = tl.atomic_add(st + _DONE, 1)
        last = ticket == tl.num_programs(0) - 1
    if last:
        if not SINGLE:
            tl.store(st + _DONE, 0)
        tl.store(st + _CALLS_SEEN, calls_seen + 1)
        tl.store(st + _STEPS_SEEN, steps_seen_new)
        tl.store(st + _CALLS_IN_STEP, j + 1)
        tl.store(st + _LAST_STEP_CALLS, tl.where(new_step & (calls_in_step > 0), calls_in_step, last_step_calls))
        tl.store(st + _CUR_SLOT, slot + 1)
        tl.store(st + _CUR_ROW, row0)
        tl.store(st + _CUR_ROWS, rows)
        head = tl.where(claim, start, head_rows)
        tl.store(st + _HEAD_ROWS, tl.where(write, tl.maximum(head, end), head))
        tl.store(st + _HEAD_STEPS, head_steps + claim.to(tl.int64))
        tl.store(st + _TOKENS, tokens + tl.where(claim, n, 0))
        tl.store(st + _CALLS_RECORDED, calls_recorded + write.to(tl.int64))
        tl.store(st + _DROPPED_FULL, dropped_full + full.to(tl.int64))
        tl.store(st + _DROPPED_LARGE, dropped_large + too_large.to(tl.int64))
        tl.store(st + _CALLS_DROPPED, calls_dropped + (active & (write == 0) & (n > 0)).to(tl.int64))
        tl.store(st + _STOPPED, tl.where(over_budget, _STOPPED_BUDGET, tl.where(refuse, _STOPPED_MISMATCH, stopped)))
        if refuse:
            tl.store(st + _MISMATCH_STEP, steps_seen_new)
            tl.store(st + _MISMATCH_KIND, _KIND_ROWS)
            tl.store(st + _MISMATCH_CALLS, j + 1)
            tl.store(st + _MISMATCH_ROWS, n)
            tl.store(st + _MISMATCH_STEP_ROWS, rows)
        tl.store(seen_ptr + pos, steps_seen_new)
        step_entry = steps_ptr + (slot % ring_steps) * _STEP_WIDTH
        if claim:
            tl.store(step_entry, start)
            tl.store(step_entry + 1, n)
            tl.store(step_entry + 2, number)
            tl.store(step_entry + 3, 0)
            tl.store(step_entry + 4, dropped_full + dropped_large)
            tl.store(step_entry + _STEP_FLAGS, 0)
        if write:
            tl.store(step_entry + 3, j + 1)
        if active & other_rows:
            tl.store(step_entry + _STEP_FLAGS, _STEP_MISMATCHED)


@triton.jit
def _end_step_kernel(
    state_ptr,  # (STATE_LEN,) int64: the ring's state words
    steps_ptr,  # (S, STEP_WIDTH) int64: step slots
    ring_steps,
    num_layers,  # calls per step, 0 if unknown
    skip_steps,
    INTERRUPTED: tl.constexpr,  # the step ends because the run stopped inside it (nothing is judged)
):
    """Grid ``(1,)``: end the current forward step. A step that ends after a number of calls that is
    not a whole number of ``num_layers`` (engines may run whole extra forwards between two
    boundaries, e.g. vLLM's dummy batches) is flagged in its slot, so the host never writes it;
    unless ``INTERRUPTED``, it is also the recording's first disagreeing step (judged from
    ``skip_steps`` on, while recording): the state words keep it and recording stops."""
    st = state_ptr
    calls = tl.load(st + _CALLS_IN_STEP)
    slot = tl.load(st + _CUR_SLOT) - 1
    steps_seen = tl.load(st + _STEPS_SEEN)
    stopped = tl.load(st + _STOPPED)
    host_stop = tl.load(st + _HOST_STOP)
    mismatch_step = tl.load(st + _MISMATCH_STEP)
    short = (num_layers > 0) & (calls > 0) & (calls < num_layers)
    if short & (slot >= 0):
        tl.store(steps_ptr + (slot % ring_steps) * _STEP_WIDTH + _STEP_FLAGS,
                 _STEP_INTERRUPTED if INTERRUPTED else _STEP_MISMATCHED)
    if not INTERRUPTED:
        if short & (stopped == 0) & (host_stop == 0) & (steps_seen - 1 - skip_steps >= 0) & (mismatch_step == 0):
            tl.store(st + _MISMATCH_STEP, steps_seen)
            tl.store(st + _MISMATCH_KIND, _KIND_CALLS)
            tl.store(st + _MISMATCH_CALLS, calls)
            tl.store(st + _STOPPED, _STOPPED_MISMATCH)
    tl.store(st + _CALLS_IN_STEP, 0)


def end_step_call(ring, interrupted: bool) -> None:
    """Launch :func:`_end_step_kernel` for ``ring`` (:class:`routetool.capture.ring.DeviceRing`) on the current stream (no sync; also inside graph capture)."""
    _end_step_kernel[(1,)](ring.state, ring.steps_table, ring.layout.steps, ring.num_layers, ring.skip_steps,
                           INTERRUPTED=bool(interrupted), num_warps=1)


TILE = 16384
"""Logits a program loads at once: 64 rows of 256 experts, one round trip for a decode batch
(ptxas for sm_90: 245 registers at 4 warps, no spills, 16-byte loads and stores)."""


def default_rows_per_program(num_experts: int) -> int:
    """Rows one program copies (in tiles of :data:`TILE` logits): 64, so that a decode batch is
    one program and needs no ticket; fewer for very many experts."""
    return max(1, min(64, 4 * TILE // min(triton.next_power_of_2(num_experts), TILE)))


RECORD_PER_CALL = ("gating_ptr", "bias_ptr", "pad_ptr", "weights_ptr", "ids_ptr", "position", "site")
"""The record kernel's parameters that change from call to call of one signature (in this order):
the call's five tensors (data pointers on a direct launch) and its layer position and site."""


def record_routing_call(ring, gating: torch.Tensor, bias: torch.Tensor, padding: torch.Tensor | None,
                        weights: torch.Tensor | None, ids: torch.Tensor | None, position: int,
                        site: int) -> KernelLaunch:
    """Launch :func:`_record_kernel` for one call on the current stream (no sync, no allocation)
    through Triton's JIT, and return the launch (:class:`routetool_kernels._dispatch.KernelLaunch`, per-call
    parameters :data:`RECORD_PER_CALL`) that later calls of the same signature (every tensor's
    dtype, shape, strides, device and alignment; the ring and its launch settings) may repeat
    directly with their own data pointers, layer position and site.

    ``ring`` is a bound :class:`routetool.capture.ring.DeviceRing`. The caller (the recorder's
    op) has checked shapes, dtypes and devices against the ring's layout; ``weights``/``ids``
    are None when the ring keeps no outputs.
    """
    lay = ring.layout
    n, num_experts = gating.shape
    rows_per_program = ring.rows_per_program or default_rows_per_program(num_experts)
    block_r = triton.next_power_of_2(rows_per_program)
    block_e = min(triton.next_power_of_2(num_experts), TILE)
    sub_r = min(block_r, max(1, TILE // block_e))
    grid = (triton.cdiv(max(n, 1), block_r),)
    has_outputs = weights is not None and ids is not None
    if not has_outputs:
        weights = ids = None
    use_pdl = ring.use_pdl if ring.use_pdl is not None else pdl_supported(gating.device)
    args = (
        None, None, None, None, None, 0, 0,  # the call's tensors, position and site (per call, leading)
        ring.state, ring.steps_table, ring.calls_table, ring.seen, ring.gating,
        ring.ids if has_outputs else None, ring.weights if has_outputs else None, ring.padding,
        n, num_experts, lay.topk,
        gating.stride(0), gating.stride(1), bias.stride(0),
        padding.stride(0) if padding is not None else 0,
        weights.stride(0) if has_outputs else 0, weights.stride(1) if has_outputs else 0,
        ids.stride(0) if has_outputs else 0, ids.stride(1) if has_outputs else 0,
        lay.rows, lay.steps, lay.max_layers, ring.num_layers, ring.skip_steps, ring.every_n_steps, ring.max_tokens,
    )
    kwargs = dict(
        BIAS_ROWS=R.bias_rows(lay.gating_dtype),
        BLOCK_R=block_r,
        SUB_R=sub_r,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(lay.topk),
        HAS_PAD=padding is not None,
        HAS_OUTPUTS=has_outputs,
        SINGLE=grid[0] == 1,
        USE_PDL=use_pdl,
        num_warps=ring.num_warps,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    launch = KernelLaunch(_record_kernel, grid, args, kwargs, RECORD_PER_CALL)
    launch.first(gating, bias, padding, weights, ids, position, site)
    return launch
