"""Deliberately broken routing kernels (test fixtures for `routetool validate`).

Each mutant has the seed's signature and one bug of a kind seen in router kernels. They are
built on the reference's public pieces so that only the planted bug differs. They route the
seed's semantics only (the suite's cases tagged ``beyond_seed`` are not theirs: see
``semantic_kernels.py`` for kernels of the other semantics and their bugs). ``MUTANTS`` maps
a name to (function, the failure class validate must report).
"""

from __future__ import annotations

import random

import torch

from routetool_kernels.reference import biased_scores, musespark1x_routing_reference, normalized_scores, select_topk


def _out(w, ids, topk_weights, topk_ids):
    """Write into caller buffers when given, as the seed's contract says."""
    T, K = ids.shape
    if topk_weights is not None:
        topk_weights[:T, :K] = w
        w = topk_weights[:T, :K]
    if topk_ids is not None:
        topk_ids[:T, :K] = ids.to(topk_ids.dtype)
        ids = topk_ids[:T, :K]
    return w, ids


def _route(gating_output, bias, topk, route_scale, router_output_multiplier=None,
           router_score_normalization="sigmoid", router_score_division_eps=None, *, is_padding=None,
           weights_from="unbiased", renormalize=True, tie_break="lowest", use_eps=True, use_multiplier=True):
    scores = normalized_scores(gating_output, router_score_normalization,
                               router_output_multiplier if use_multiplier else None)
    biased = biased_scores(scores, bias)
    if tie_break == "lowest":
        ids = select_topk(biased, topk)
    else:  # highest index among equal keys: reverse, stable sort, map back
        E = biased.shape[1]
        ids = (E - 1) - select_topk(biased.flip(-1), topk)
    src = scores if weights_from == "unbiased" else biased
    picked = src.gather(1, ids)
    if renormalize:
        denom = picked.sum(-1, keepdim=True)
        if use_eps and router_score_division_eps is not None:
            denom = denom + router_score_division_eps
        w = torch.where(denom > 0, picked * (route_scale / torch.where(denom > 0, denom, 1.0)), 0.0)
    else:
        w = picked * route_scale
    ids = ids.to(torch.int32)
    if is_padding is not None:
        ids = torch.where(is_padding[:, None], -1, ids)
        w = torch.where(is_padding[:, None], 0.0, w)
    return w, ids


def _kernel(**bug):
    def fn(gating_output, bias, topk, route_scale, router_output_multiplier=None, router_score_normalization="sigmoid",
           router_score_division_eps=None, topk_weights=None, topk_ids=None, *, is_padding=None):
        w, ids = _route(gating_output, bias, topk, route_scale, router_output_multiplier, router_score_normalization,
                        router_score_division_eps, is_padding=is_padding, **bug)
        return _out(w, ids, topk_weights, topk_ids)
    return fn


def correct(gating_output, bias, topk, route_scale, router_output_multiplier=None, router_score_normalization="sigmoid",
            router_score_division_eps=None, topk_weights=None, topk_ids=None, *, is_padding=None, **beyond_seed):
    """The reference, writing into caller buffers (int32 or int64 ids), with every semantics it
    routes (``n_group``, ``norm_topk_prob``... by keyword)."""
    w, ids = musespark1x_routing_reference(gating_output, bias, topk, route_scale, router_output_multiplier,
                                           router_score_normalization, router_score_division_eps, is_padding=is_padding,
                                           **beyond_seed)
    return _out(w, ids, topk_weights, topk_ids)


highest_index_ties = _kernel(tie_break="highest")
highest_index_ties.__doc__ = "Correct routing that breaks ties toward the highest expert index."


def biased_weights(*a, **k):
    return _kernel(weights_from="biased")(*a, **k)


def not_renormalized(*a, **k):
    return _kernel(renormalize=False)(*a, **k)


def eps_ignored(*a, **k):
    return _kernel(use_eps=False)(*a, **k)


def multiplier_ignored(*a, **k):
    return _kernel(use_multiplier=False)(*a, **k)


def padding_ignored(gating_output, bias, topk, route_scale, *a, is_padding=None, **k):
    return correct(gating_output, bias, topk, route_scale, *a, is_padding=None, **k)


def padded_weights_kept(gating_output, bias, topk, route_scale, router_output_multiplier=None,
                        router_score_normalization="sigmoid", router_score_division_eps=None, topk_weights=None,
                        topk_ids=None, *, is_padding=None):
    w, ids = musespark1x_routing_reference(gating_output, bias, topk, route_scale, router_output_multiplier,
                                           router_score_normalization, router_score_division_eps)
    if is_padding is not None:
        ids = torch.where(is_padding[:, None], -1, ids)
    return _out(w, ids, topk_weights, topk_ids)


def nan_unsafe(gating_output, bias, topk, route_scale, router_output_multiplier=None,
               router_score_normalization="sigmoid", router_score_division_eps=None, topk_weights=None, topk_ids=None,
               *, is_padding=None):
    """The seed's arithmetic on non-finite input: NaN logits give NaN weights, 0/0 is NaN."""
    x = gating_output.float() * (router_output_multiplier or 1.0)
    if router_score_normalization == "sigmoid":
        s = torch.sigmoid(x)
    else:
        s = torch.softmax(x, dim=-1)
    key = torch.nan_to_num(s + bias.float(), nan=float("-inf"))
    ids = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :topk]
    picked = s.gather(1, ids)
    w = picked * (route_scale / (picked.sum(-1, keepdim=True) + (router_score_division_eps or 0.0)))
    ids = ids.to(torch.int32)
    if is_padding is not None:
        ids = torch.where(is_padding[:, None], -1, ids)
        w = torch.where(is_padding[:, None], 0.0, w)
    return _out(w, ids, topk_weights, topk_ids)


def duplicate_on_ties(gating_output, bias, topk, route_scale, router_output_multiplier=None,
                      router_score_normalization="sigmoid", router_score_division_eps=None, topk_weights=None,
                      topk_ids=None, *, is_padding=None):
    """Masks every expert equal to the max at once, then refills the freed slot with the first pick."""
    w, ids = musespark1x_routing_reference(gating_output, bias, topk, route_scale, router_output_multiplier,
                                           router_score_normalization, router_score_division_eps,
                                           is_padding=is_padding)
    scores = normalized_scores(gating_output, router_score_normalization, router_output_multiplier)
    b = biased_scores(scores, bias).gather(1, ids.clamp_min(0).long())
    tied = (b[:, 1:] == b[:, :-1]).any(-1) & (ids[:, 0] >= 0)
    ids = ids.clone()
    ids[tied, -1] = ids[tied, 0]
    return _out(w, ids, topk_weights, topk_ids)


def padded_lane_ids(gating_output, bias, topk, route_scale, *a, topk_weights=None, topk_ids=None, **k):
    """Returns ids of the power-of-two padding lanes for a non-power-of-two expert count."""
    w, ids = musespark1x_routing_reference(gating_output, bias, topk, route_scale, *a, **k)
    E = gating_output.shape[1]
    e_pad = 1 << max(3, (E - 1).bit_length())
    if e_pad != E:
        ids = torch.where(ids >= 0, ids + (e_pad - E) * (ids == ids.max()), ids)
    return _out(w, ids, topk_weights, topk_ids)


def row_dependent_ties(gating_output, bias, topk, route_scale, *a, topk_weights=None, topk_ids=None, **k):
    """Breaks ties toward the lowest index on even rows and the highest on odd rows."""
    w_lo, ids_lo = correct(gating_output, bias, topk, route_scale, *a, **k)
    w_hi, ids_hi = highest_index_ties(gating_output, bias, topk, route_scale, *a, **k)
    odd = (torch.arange(ids_lo.shape[0], device=ids_lo.device) % 2 == 1)[:, None]
    return _out(torch.where(odd, w_hi, w_lo), torch.where(odd, ids_hi, ids_lo), topk_weights, topk_ids)


def assumes_contiguous(gating_output, bias, topk, route_scale, *a, **k):
    """Reads gating_output as if it were contiguous (ignores strides)."""
    T, E = gating_output.shape
    flat = torch.as_strided(gating_output, (T, E), (E, 1))
    return correct(flat, bias, topk, route_scale, *a, **k)


def writes_whole_buffer(gating_output, bias, topk, route_scale, *a, topk_weights=None, topk_ids=None, **k):
    """Zeroes the whole caller buffer before writing its [num_tokens, topk] view."""
    if topk_weights is not None:
        topk_weights.zero_()
    return correct(gating_output, bias, topk, route_scale, *a, topk_weights=topk_weights, topk_ids=topk_ids, **k)


def int64_ids_as_int32(gating_output, bias, topk, route_scale, *a, topk_weights=None, topk_ids=None, **k):
    """Writes int32 ids into the bytes of an int64 buffer."""
    w, ids = correct(gating_output, bias, topk, route_scale, *a, topk_weights=topk_weights, **k)
    if topk_ids is not None and topk_ids.dtype == torch.int64:
        T, K = ids.shape
        raw = topk_ids.view(torch.int32)
        raw[:T, :K] = ids
        return w, topk_ids[:T, :K]
    return _out(w, ids, None, topk_ids)


_STALE: dict = {}


def stale_padding(gating_output, bias, topk, route_scale, *a, is_padding=None, **k):
    """Caches the padding mask and bias of the first call on a buffer (as a kernel that copies
    them into static storage once would)."""
    key = (gating_output.data_ptr(), None if is_padding is None else is_padding.data_ptr())
    if key not in _STALE:
        _STALE[key] = (bias.clone(), None if is_padding is None else is_padding.clone())
    cached_bias, cached_pad = _STALE[key]
    return correct(gating_output, cached_bias, topk, route_scale, *a, is_padding=cached_pad, **k)


def rejects_bf16(gating_output, *a, **k):
    # (no docstring: the rejection is not documented)
    if gating_output.dtype != torch.float32:
        raise ValueError("only float32 supported")
    return correct(gating_output, *a, **k)


def crashes_on_one_expert(gating_output, *a, **k):
    if gating_output.shape[1] == 1:
        raise RuntimeError("index out of bounds")
    return correct(gating_output, *a, **k)


def zeroes_its_inputs(gating_output, bias, *a, **k):
    # a correct answer computed first, then the inputs overwritten: a reference computed
    # afterwards from the same tensors would agree with whatever the kernel returned
    out = correct(gating_output, bias, *a, **k)
    gating_output.zero_()
    bias.zero_()
    return out


def exits(gating_output, *a, **k):
    if gating_output.shape[1] == 1:
        raise SystemExit(0)
    return correct(gating_output, *a, **k)


_CALLS = {"racy_ties": 0, "atomic_order_sum": 0}


def racy_ties(gating_output, bias, topk, route_scale, *a, topk_weights=None, topk_ids=None, **k):
    """Breaks ties toward the lowest expert index on one call and the highest on the next, as a
    tie-break decided by whichever thread's atomic lands first would."""
    _CALLS["racy_ties"] += 1
    pick = correct if _CALLS["racy_ties"] % 2 else highest_index_ties
    w, ids = pick(gating_output, bias, topk, route_scale, *a, **k)
    return _out(w, ids, topk_weights, topk_ids)


COINS = random.Random(0)
"""The coin of :func:`coin_toss_ties` (seeded by the tests that use it)."""


def coin_toss_ties(gating_output, bias, topk, route_scale, *a, topk_weights=None, topk_ids=None, **k):
    """Breaks every call's ties toward the lowest or the highest expert index by a coin tossed per
    call: two calls on one input agree half the time, so one repeated call may see no difference
    and the next call, on rows in another order, one."""
    pick = correct if COINS.random() < 0.5 else highest_index_ties
    w, ids = pick(gating_output, bias, topk, route_scale, *a, **k)
    return _out(w, ids, topk_weights, topk_ids)


def floor_tiles_above_256(gating_output, bias, topk, route_scale, *a, topk_weights=None, topk_ids=None, **k):
    """Above 256 tokens takes its prefill path, launched on ``T // 256`` tiles of 256 rows (a floor
    where a ceiling division belongs): the last ``T % 256`` rows are never written and keep the
    zeros their outputs were allocated with."""
    w, ids = correct(gating_output, bias, topk, route_scale, *a, **k)
    T = gating_output.shape[0]
    if T > 256:
        done = T // 256 * 256
        w, ids = w.clone(), ids.clone()
        w[done:], ids[done:] = 0.0, 0
    return _out(w, ids, topk_weights, topk_ids)


def _weights_summed(gating_output, bias, topk, route_scale, router_output_multiplier=None,
                    router_score_normalization="sigmoid", router_score_division_eps=None, *, is_padding=None,
                    reverse=False):
    """The reference's ids; weights renormalised by a sum taken slot by slot, first to last or last to first."""
    _, ids = musespark1x_routing_reference(gating_output, bias, topk, route_scale, router_output_multiplier,
                                           router_score_normalization, router_score_division_eps)
    picked = normalized_scores(gating_output, router_score_normalization, router_output_multiplier).gather(
        1, ids.long())
    denom = torch.zeros(picked.shape[0], 1, device=picked.device)
    for j in (reversed(range(topk)) if reverse else range(topk)):
        denom = denom + picked[:, j:j + 1]
    if router_score_division_eps is not None:
        denom = denom + router_score_division_eps
    w = torch.where(denom > 0, picked * (route_scale / torch.where(denom > 0, denom, 1.0)), 0.0)
    if is_padding is not None:
        ids = torch.where(is_padding[:, None], -1, ids)
        w = torch.where(is_padding[:, None], 0.0, w)
    return w, ids


def atomic_order_sum(gating_output, bias, topk, route_scale, router_output_multiplier=None,
                     router_score_normalization="sigmoid", router_score_division_eps=None, topk_weights=None,
                     topk_ids=None, *, is_padding=None):
    """Sums each row's picked scores in another order on every other call (as float atomics
    landing in another order do): the same ids, weights that differ in their last bits."""
    _CALLS["atomic_order_sum"] += 1
    w, ids = _weights_summed(gating_output, bias, topk, route_scale, router_output_multiplier,
                             router_score_normalization, router_score_division_eps, is_padding=is_padding,
                             reverse=_CALLS["atomic_order_sum"] % 2 == 0)
    return _out(w, ids, topk_weights, topk_ids)


def large_batch_rounding(gating_output, bias, topk, route_scale, router_output_multiplier=None,
                         router_score_normalization="sigmoid", router_score_division_eps=None, topk_weights=None,
                         topk_ids=None, *, is_padding=None):
    """Above 128 tokens takes its prefill path, which sums the picked scores last slot first:
    a token's weights change in their last bits with the size of the batch it comes in."""
    w, ids = _weights_summed(gating_output, bias, topk, route_scale, router_output_multiplier,
                             router_score_normalization, router_score_division_eps, is_padding=is_padding,
                             reverse=gating_output.shape[0] > 128)
    return _out(w, ids, topk_weights, topk_ids)


def wrong_at_160_experts_k8(gating_output, bias, topk, route_scale, *a, **k):
    """A kernel specialised per (num_experts, topk) whose (160, 8) instance (GLM-4.5's router)
    reads only the first 128 experts."""
    if gating_output.shape[1] == 160 and topk == 8:
        gating_output = gating_output.clone()
        gating_output[:, 128:] = float("-inf")
    return correct(gating_output, bias, topk, route_scale, *a, **k)


def eight_slots(gating_output, bias, topk, route_scale, *a, topk_weights=None, topk_ids=None, **k):
    """Keeps its picks in 8 slots: for topk above 8 the slots from 8 on repeat the first ones."""
    w, ids = correct(gating_output, bias, topk, route_scale, *a, **k)
    if topk > 8:
        slots = torch.arange(topk, device=ids.device) % 8
        w, ids = w[:, slots], ids[:, slots]
    return _out(w, ids, topk_weights, topk_ids)


MUTANTS = {
    "biased_weights": (biased_weights, "weights_not_renormalized_unbiased"),
    "not_renormalized": (not_renormalized, "weight_sum"),
    "eps_ignored": (eps_ignored, "weights_not_renormalized_unbiased"),
    "multiplier_ignored": (multiplier_ignored, "mismatch"),
    "padding_ignored": (padding_ignored, "invalid:bad_padding"),
    "padded_weights_kept": (padded_weights_kept, "invalid:bad_padding"),
    "nan_unsafe": (nan_unsafe, "invalid:nonfinite_weight"),
    "duplicate_on_ties": (duplicate_on_ties, "invalid:duplicate_id"),
    "padded_lane_ids": (padded_lane_ids, "invalid:id_out_of_range"),
    "row_dependent_ties": (row_dependent_ties, "row_order_dependence"),
    "assumes_contiguous": (assumes_contiguous, "mismatch"),
    "writes_whole_buffer": (writes_whole_buffer, "wrote_outside_view"),
    "int64_ids_as_int32": (int64_ids_as_int32, "invalid:id_out_of_range"),
    "stale_padding": (stale_padding, "stale_output"),
    "rejects_bf16": (rejects_bf16, "rejected_undocumented"),
    "crashes_on_one_expert": (crashes_on_one_expert, "crash"),
    "zeroes_its_inputs": (zeroes_its_inputs, "modified_input"),
    "exits": (exits, "crash"),
    "racy_ties": (racy_ties, "nondeterministic"),
    "coin_toss_ties": (coin_toss_ties, "nondeterministic"),
    "floor_tiles_above_256": (floor_tiles_above_256, "invalid:duplicate_id"),
    "atomic_order_sum": (atomic_order_sum, "nondeterministic"),
    "large_batch_rounding": (large_batch_rounding, "batch_variant"),
    "wrong_at_160_experts_k8": (wrong_at_160_experts_k8, "mismatch"),
    "eight_slots": (eight_slots, "invalid:duplicate_id"),
}
