"""The record kernel: one launch copies one routing call into the recorder's device ring.

Algorithm (the ring's layout and state words: :mod:`routetool.capture.ring`). Every program
of a launch loads the same state words (nothing writes them until all programs are done),
so all take the same decisions: does this call start a forward step (the first call, a call
after ``num_layers`` calls, a repeated layer position, or after ``end_step``), is the step
sampled (``skip_steps``, ``every_n_steps``, ``max_tokens``, stopped), is there room for the
whole step (``calls x rows`` consecutive rows between the claimed end and the released start,
and a free step slot), and where this call's rows go. Each program copies its block of rows
(logits, padding, ids, weights); program 0 also writes the call's table entry and stores or
compares the layer's bias. The last program to finish (a ticket taken with an atomic add;
with one program, that program) writes the new state words. Launches on one stream run one
after the other, so the next call sees them. Nothing here waits for the host: CUDA-graph
capture records the launch and every replay repeats it.

This module imports Triton: import it lazily (after ``TRITON_INTERPRET`` is settled).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from routetool.capture import ring as R

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
_BIAS_CHANGED_STEP = tl.constexpr(R.STATE_BIAS_CHANGED_STEP)
_BIAS_CHANGED_POS = tl.constexpr(R.STATE_BIAS_CHANGED_POS)
_DONE = tl.constexpr(R.STATE_DONE)
_BIAS_FLAG = tl.constexpr(R.STATE_BIAS_FLAG)
_RELEASED_ROWS = tl.constexpr(R.STATE_RELEASED_ROWS)
_RELEASED_STEPS = tl.constexpr(R.STATE_RELEASED_STEPS)
_HOST_STOP = tl.constexpr(R.STATE_HOST_STOP)
_STOPPED_BUDGET = tl.constexpr(R.STOPPED_BUDGET)
_STOPPED_BIAS = tl.constexpr(R.STOPPED_BIAS)
_STEP_WIDTH = tl.constexpr(R.STEP_WIDTH)
_CALL_WIDTH = tl.constexpr(R.CALL_WIDTH)
_TAG_MOD = tl.constexpr(R._TAG_MOD)


@triton.jit(do_not_specialize=["num_tokens", "position", "site"])
def _record_kernel(
    state_ptr,  # (STATE_LEN,) int64: the ring's state words
    steps_ptr,  # (S, STEP_WIDTH) int64: step slots
    calls_ptr,  # (S, L, CALL_WIDTH) int32: the calls of each step slot
    seen_ptr,  # (L,) int64: the step each layer position was last called in (+1)
    bias_set_ptr,  # (L,) int32: the layer position's bias is stored
    bias_first_ptr,  # (L, E) fp32: the stored biases
    g_ring_ptr,  # (R, E) the logits' dtype: rows
    i_ring_ptr,  # (R, K) int32, or None
    w_ring_ptr,  # (R, K) fp32|bf16|fp16, or None
    p_ring_ptr,  # (R,) uint8
    gating_ptr,  # (T, E) fp32|bf16|fp16, any strides
    bias_ptr,  # (E,) fp32|bf16|fp16, any stride
    pad_ptr,  # (T,) bool, or None
    weights_ptr,  # (T, K) fp32|bf16|fp16|fp64, any strides, or None
    ids_ptr,  # (T, K) int32|int64, any strides, or None
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
    position,  # the call's layer position (>= 0), or -1: its place in the step
    site,  # the host's number of the call's router parameters
    ring_rows,
    ring_steps,
    max_layers,
    num_layers,  # calls per step, 0 if unknown
    skip_steps,
    every_n_steps,
    max_tokens,  # -1: no budget
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_OUTPUTS: tl.constexpr,
    SINGLE: tl.constexpr,  # one program: no ticket
):
    """Grid ``(cdiv(max(T, 1), BLOCK_R),)``: program ``p`` copies rows ``[p * BLOCK_R, (p + 1) * BLOCK_R)``."""
    pid = tl.program_id(0)
    st = state_ptr
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
    n = num_tokens.to(tl.int64)
    given = position.to(tl.int64)

    # the step and the call's place in it
    explicit = given >= 0
    by_order = tl.where(calls_in_step >= num_layers, 0, calls_in_step)
    pos = tl.where(explicit, given, by_order)
    seen_pos = tl.load(seen_ptr + pos)
    new_step = (calls_in_step == 0) | ((num_layers > 0) & (calls_in_step >= num_layers)) | (
        explicit & (seen_pos == steps_seen))
    steps_seen_new = steps_seen + new_step.to(tl.int64)
    number = steps_seen_new - 1
    j = tl.where(new_step, 0, calls_in_step)
    rel = number - skip_steps
    running = (stopped == 0) & (host_stop == 0)
    sampled = new_step & (rel >= 0) & (rel % every_n_steps == 0) & running & (n > 0)
    over_budget = sampled & (max_tokens >= 0) & (tokens + n > max_tokens)
    sampled = sampled & (over_budget == 0)
    # room for the whole step: calls x rows consecutive rows, and a step slot
    expect = tl.where(num_layers > 0, num_layers, tl.maximum(last_step_calls, 1))
    reserve = n * expect
    too_large = sampled & (reserve > ring_rows)
    phys = head_rows % ring_rows
    start = tl.where(phys + reserve > ring_rows, head_rows - phys + ring_rows, head_rows)
    full = sampled & (too_large == 0) & (
        (start + reserve - released_rows > ring_rows) | (head_steps - released_steps >= ring_steps))
    claim = sampled & (too_large == 0) & (full == 0)
    slot = tl.where(claim, head_steps, tl.where(new_step, -1, cur_slot))
    row0 = tl.where(claim, start, cur_row)
    rows = tl.where(claim, n, cur_rows)
    active = slot >= 0
    end = row0 + (j + 1) * rows
    write = active & (n == rows) & (j < max_layers) & ((row0 % ring_rows) + (j + 1) * rows <= ring_rows) & (
        end - released_rows <= ring_rows)
    dst_row = row0 % ring_rows + j * rows

    # the rows
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < tl.where(write, n, 0)  # no rows unless the call is written
    src_r = r.to(tl.int64)
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

    # program 0: the call's table entry and the layer's bias
    changed = pid * 0  # bias entries that differ from the layer's stored bias (int32)
    if pid == 0:
        if write:
            entry = calls_ptr + ((slot % ring_steps) * max_layers + j) * _CALL_WIDTH
            tl.store(entry, pos.to(tl.int32))
            tl.store(entry + 1, site)
            tl.store(entry + 2, 1 if HAS_PAD else 0)
            tl.store(entry + 3, (slot % _TAG_MOD + 1).to(tl.int32))
            set_ptr = bias_set_ptr + pos
            stored = tl.load(set_ptr)
            first = bias_first_ptr + pos * num_experts
            for c0 in range(0, num_experts, BLOCK_E):
                c = c0 + tl.arange(0, BLOCK_E)
                cm = c < num_experts
                b = tl.load(bias_ptr + c * stride_b, mask=cm, other=0.0).to(tl.float32)
                if stored == 0:
                    tl.store(first + c, b, mask=cm)
                else:
                    f = tl.load(first + c, mask=cm, other=0.0)
                    differs = cm & (b.to(tl.int32, bitcast=True) != f.to(tl.int32, bitcast=True))
                    changed += tl.sum(differs.to(tl.int32), axis=0)
            if stored == 0:
                tl.store(set_ptr, 1)
            if not SINGLE:
                if changed > 0:
                    tl.store(st + _BIAS_FLAG, pos + 1)

    # the last program: the new state words
    if SINGLE:
        last = pid == 0
    else:
        ticket = tl.atomic_add(st + _DONE, 1)
        last = ticket == tl.num_programs(0) - 1
    if last:
        if SINGLE:
            flag = tl.where(changed > 0, pos + 1, 0)
        else:
            flag = tl.atomic_xchg(st + _BIAS_FLAG, 0)
            tl.store(st + _DONE, 0)
        calls_seen = tl.load(st + _CALLS_SEEN)
        calls_recorded = tl.load(st + _CALLS_RECORDED)
        dropped_full = tl.load(st + _DROPPED_FULL)
        dropped_large = tl.load(st + _DROPPED_LARGE)
        calls_dropped = tl.load(st + _CALLS_DROPPED)
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
        reason = tl.where(flag > 0, _STOPPED_BIAS, tl.where(over_budget, _STOPPED_BUDGET, 0))
        tl.store(st + _STOPPED, tl.where(stopped != 0, stopped, reason))
        if flag > 0:
            if tl.load(st + _BIAS_CHANGED_STEP) == 0:
                tl.store(st + _BIAS_CHANGED_STEP, number + 1)
                tl.store(st + _BIAS_CHANGED_POS, (flag - 1).to(tl.int64))
        tl.store(seen_ptr + pos, steps_seen_new)
        step_entry = steps_ptr + (slot % ring_steps) * _STEP_WIDTH
        if claim:
            tl.store(step_entry, start)
            tl.store(step_entry + 1, n)
            tl.store(step_entry + 2, number)
            tl.store(step_entry + 3, 0)
            tl.store(step_entry + 4, dropped_full + dropped_large)
        if write:
            tl.store(step_entry + 3, j + 1)


def default_rows_per_program(num_experts: int) -> int:
    """Rows one program copies: a tile of about 16K logits, at most 64 rows."""
    return max(1, min(64, 16384 // min(triton.next_power_of_2(num_experts), 4096)))


def record_routing_call(ring: R.DeviceRing, gating: torch.Tensor, bias: torch.Tensor, padding: torch.Tensor | None,
                        weights: torch.Tensor | None, ids: torch.Tensor | None, position: int, site: int) -> None:
    """Launch :func:`_record_kernel` for one call on the current stream (no sync, no allocation).

    The caller (the recorder's op) has checked shapes, dtypes and devices against the ring's
    layout; ``weights``/``ids`` are None when the ring keeps no outputs.
    """
    lay = ring.layout
    n, num_experts = gating.shape
    rows_per_program = ring.rows_per_program or default_rows_per_program(num_experts)
    block_r = triton.next_power_of_2(rows_per_program)
    grid = (triton.cdiv(max(n, 1), block_r),)
    has_outputs = weights is not None and ids is not None
    _record_kernel[grid](
        ring.state, ring.steps_table, ring.calls_table, ring.seen, ring.bias_set, ring.bias_first, ring.gating,
        ring.ids if has_outputs else None, ring.weights if has_outputs else None, ring.padding,
        gating, bias, padding, weights if has_outputs else None, ids if has_outputs else None,
        n, num_experts, lay.topk,
        gating.stride(0), gating.stride(1), bias.stride(0),
        padding.stride(0) if padding is not None else 0,
        weights.stride(0) if has_outputs else 0, weights.stride(1) if has_outputs else 0,
        ids.stride(0) if has_outputs else 0, ids.stride(1) if has_outputs else 0,
        position, site,
        lay.rows, lay.steps, lay.max_layers, ring.num_layers, ring.skip_steps, ring.every_n_steps, ring.max_tokens,
        BLOCK_R=block_r,
        BLOCK_E=min(triton.next_power_of_2(num_experts), 4096),
        BLOCK_K=triton.next_power_of_2(lay.topk),
        HAS_PAD=padding is not None,
        HAS_OUTPUTS=has_outputs,
        SINGLE=grid[0] == 1,
        num_warps=ring.num_warps,
    )
