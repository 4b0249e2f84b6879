"""The device ring's layout: its state words, step and call tables, and byte offsets.

What the host side (:mod:`routetool.capture.ring`) and the record kernel
(:mod:`routetool.capture.ring_kernel`) both read, so that neither imports the other for it:
the ``STATE_*`` words and their values, the widths of a step slot and of a call entry, how a
call's bias is kept in ring rows, and where each region of the buffer starts
(:class:`RingLayout`; the table of regions is in :mod:`routetool.capture.ring`'s docstring).
Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# -- state words ---------------------------------------------------------------------------
# written by the device (the last program of each record kernel)
STATE_HEAD_ROWS = 0  # virtual rows claimed
STATE_HEAD_STEPS = 1  # step slots claimed (= steps recorded)
STATE_STEPS_SEEN = 2  # forward steps seen (the current step's number + 1)
STATE_CALLS_IN_STEP = 3  # calls seen in the current step (0: the next call starts a step)
STATE_CUR_SLOT = 4  # the current step's slot + 1 (0: the current step is not recorded)
STATE_CUR_ROW = 5  # the current step's first virtual row
STATE_CUR_ROWS = 6  # the current step's rows per call
STATE_LAST_STEP_CALLS = 7  # calls of the previous step (the reservation when num_layers is unknown)
STATE_TOKENS = 8  # token rows recorded per layer (sum of the recorded steps' rows)
STATE_CALLS_SEEN = 9
STATE_CALLS_RECORDED = 10
STATE_DROPPED_FULL = 11  # sampled steps dropped: the ring was full
STATE_DROPPED_LARGE = 12  # sampled steps dropped: larger than the whole ring
STATE_CALLS_DROPPED = 13  # calls of a recorded step not stored (other rows than the step, no slot)
STATE_STOPPED = 14  # 0 recording, 1 the max_tokens budget was reached, 2 a step disagreed (STATE_MISMATCH_*)
STATE_MISMATCH_STEP = 15  # the first step whose calls disagreed with num_layers (its number + 1; 0: none)
STATE_MISMATCH_KIND = 16  # how: MISMATCH_CALLS or MISMATCH_ROWS
STATE_DONE = 17  # programs of the running launch that finished (reset by the last one)
STATE_MISMATCH_CALLS = 18  # MISMATCH_CALLS: the calls the step ended with; MISMATCH_ROWS: the call's place (1-based)
STATE_MISMATCH_ROWS = 19  # MISMATCH_ROWS: the call's rows
STATE_MISMATCH_STEP_ROWS = 20  # MISMATCH_ROWS: the rows of the step's first call
# written by the host only (the device reads them)
STATE_RELEASED_ROWS = 24  # virtual rows the host has copied (the device may reuse rows below)
STATE_RELEASED_STEPS = 25  # step slots the host has copied
STATE_HOST_STOP = 26  # 1: the host stopped recording (closed, or a recorder problem)
STATE_LEN = 32

STOPPED_BUDGET = 1
STOPPED_MISMATCH = 2
MISMATCH_CALLS = 1  # a step boundary came after a number of calls that is not a whole number of num_layers
MISMATCH_ROWS = 2  # a call has other rows than its step's first call (one step's calls route the same tokens)

STEP_ROW = 0
STEP_ROWS = 1
STEP_NUMBER = 2
STEP_CALLS = 3
STEP_DROPS_BEFORE = 4
STEP_FLAGS = 5  # 0, or why the step must not be written: STEP_INTERRUPTED / STEP_MISMATCHED
STEP_INTERRUPTED = 1  # ended (by an exception, at close) before all its calls ran
STEP_MISMATCHED = 2  # its calls disagreed with num_layers
STEP_WIDTH = 8
CALL_WIDTH = 4
_ALIGN = 256
_TAG_MOD = 2**31 - 1


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def bias_rows(gating_dtype: torch.dtype) -> int:
    """Ring rows after a call's rows that hold its float32 bias: 1 for float32 logits; 2 for
    16-bit logits (the bits' high halves, then the low halves)."""
    return 1 if gating_dtype.itemsize == 4 else 2


def split_bias(bias: torch.Tensor, gating_dtype: torch.dtype) -> torch.Tensor:
    """``bias`` (float32 ``[E]``) as the ``[bias_rows, E]`` rows of ``gating_dtype`` the ring keeps."""
    bits = bias.to(torch.float32).contiguous().view(torch.int32)
    if gating_dtype.itemsize == 4:
        return bits.view(gating_dtype).unsqueeze(0)
    hi = (bits >> 16).to(torch.int16)
    lo = (bits & 0xFFFF).to(torch.int16)
    return torch.stack([hi, lo]).view(gating_dtype)


def join_bias(rows: torch.Tensor) -> torch.Tensor:
    """The float32 bias back from its ring rows (:func:`split_bias`)."""
    if rows.shape[0] == 1:
        return rows[0].view(torch.int32).view(torch.float32).clone()
    hi = rows[0].view(torch.int16).to(torch.int32)
    lo = rows[1].view(torch.int16).to(torch.int32) & 0xFFFF
    return ((hi << 16) | lo).view(torch.float32)


def call_tag(slot: int) -> int:
    """The tag a call's table entry carries, so that a stale entry of an earlier lap is told apart."""
    return slot % _TAG_MOD + 1


@dataclass(frozen=True)
class RingLayout:
    """Where each region of the ring's buffer starts (byte offsets) and how large it is.

    ``rows`` (R) is fixed by :meth:`DeviceRing.bind`, from the bytes the header leaves.
    """

    ring_bytes: int
    steps: int
    max_layers: int
    header_bytes: int
    off_steps: int
    off_calls: int
    off_seen: int
    num_experts: int = 0
    topk: int = 0
    gating_dtype: torch.dtype | None = None
    weights_dtype: torch.dtype | None = None
    record_outputs: bool = True
    rows: int = 0
    off_gating: int = 0
    off_ids: int = 0
    off_weights: int = 0
    off_padding: int = 0

    @property
    def bound(self) -> bool:
        return self.gating_dtype is not None

    def row_bytes(self) -> int:
        """Ring bytes one recorded token row of one call takes."""
        size = self.num_experts * self.gating_dtype.itemsize + 1
        if self.record_outputs:
            size += self.topk * (4 + self.weights_dtype.itemsize)
        return size


def header_layout(ring_bytes: int, steps: int, max_layers: int) -> RingLayout:
    off_steps = _align(STATE_LEN * 8)
    off_calls = _align(off_steps + steps * STEP_WIDTH * 8)
    off_seen = _align(off_calls + steps * max_layers * CALL_WIDTH * 4)
    header = _align(off_seen + max_layers * 8)
    return RingLayout(ring_bytes=ring_bytes, steps=steps, max_layers=max_layers, header_bytes=header,
                      off_steps=off_steps, off_calls=off_calls, off_seen=off_seen)
