"""Routing kernels written to the semantics of production models, and their classic bugs (test
fixtures for `routetool validate --kernel`, docs/semantics.md).

:func:`engine_router` is written the way engines write their routers in PyTorch (DeepSeek-V3's
``noaux_tc`` gate and vLLM's ``grouped_topk``; Qwen2-MoE's and OLMoE's ``norm_topk_prob``; gpt-oss's
top-k of the logits then softmax; DeepSeek-V4's ``sqrt(softplus)``), from their published
semantics and not from routetool's reference, so that validate judges one implementation by
another. Each bug kernel is the same router with one planted bug; :data:`BUGS` maps its name to
(the kernel, the suite case it must fail, a failure class validate must report there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mutants import _out


def _scores(x: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "sigmoid":
        return x.sigmoid()
    if scoring == "softmax":
        return x.softmax(dim=-1)
    if scoring == "sqrtsoftplus":
        return F.softplus(x).sqrt()
    if scoring == "topk_then_softmax":
        return x
    raise ValueError(f"unknown router_score_normalization {scoring!r}")


def _top(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest per row, equal keys to the lowest index (a stable sort: the engines' topk
    leaves ties unspecified)."""
    return torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :k]


def engine_router(gating_output, bias, topk, route_scale, router_output_multiplier=None,
                  router_score_normalization="sigmoid", router_score_division_eps=None, topk_weights=None,
                  topk_ids=None, *, is_padding=None, n_group=None, topk_group=None, topk_method=None,
                  norm_topk_prob=None, bug=None):
    """Sigmoid, softmax, sqrtsoftplus or topk_then_softmax scores; the bias selects; group-limited
    selection (the best topk_group of n_group groups by the sum of their top-2 keys, or by their best
    with topk_method=group_limited_greedy); weights
    renormalised (+ eps), or not with norm_topk_prob=False, or a softmax over the picked logits;
    times route_scale; padded rows -1 / 0."""
    x = gating_output.float()
    if router_output_multiplier is not None:
        x = x * router_output_multiplier
    scoring = router_score_normalization
    if bug == "sqrt_missing" and scoring == "sqrtsoftplus":
        s = F.softplus(x)
    else:
        s = _scores(x, "softmax" if bug == "softmax_before_topk" and scoring == "topk_then_softmax" else scoring)
    keys = s + bias.float()
    if bug == "keys_in_bias_dtype":  # the sum computed in the bias's dtype, as a kernel that adds in bf16
        keys = (s.to(bias.dtype) + bias).float()
    if n_group is not None and bug != "groups_ignored":
        T, E = keys.shape
        grouped = keys.view(T, n_group, E // n_group)
        by_max = topk_method == "group_limited_greedy" and bug != "topk_method_ignored"
        if by_max or bug == "group_max":  # (vLLM's rule for a router without a bias)
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(min(2, E // n_group), dim=-1).values.sum(dim=-1)
        kept = torch.zeros(T, n_group, dtype=torch.bool, device=keys.device)
        kept.scatter_(1, _top(group_scores, topk_group), True)
        keys = keys.masked_fill(~kept.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = _top(keys, topk)
    picked = s.gather(1, ids)
    if scoring == "topk_then_softmax":
        w = picked if bug == "softmax_before_topk" else picked.softmax(dim=-1)
    elif norm_topk_prob is False and bug != "always_renormalized":
        w = picked
    else:
        denom = picked.sum(dim=-1, keepdim=True)
        if router_score_division_eps is not None:
            denom = denom + router_score_division_eps
        w = picked / denom
    w = w * route_scale
    ids = ids.to(torch.int32)
    if is_padding is not None:
        ids = torch.where(is_padding[:, None], -1, ids)
        w = torch.where(is_padding[:, None], 0.0, w)
    return _out(w, ids, topk_weights, topk_ids)


def _with_bug(bug: str, doc: str):
    def fn(*args, **kwargs):
        return engine_router(*args, bug=bug, **kwargs)
    fn.__doc__ = doc
    fn.__name__ = bug
    return fn


groups_ignored = _with_bug("groups_ignored", "Plain top-k over every expert: n_group and topk_group ignored.")
group_max = _with_bug("group_max", "Groups scored by their best key, not the sum of their top 2.")
topk_method_ignored = _with_bug("topk_method_ignored", "Groups by their top-2 sum whatever topk_method says.")
always_renormalized = _with_bug("always_renormalized", "Weights renormalised whatever norm_topk_prob says.")
softmax_before_topk = _with_bug("softmax_before_topk", "gpt-oss routed as softmax over every expert, then top-k, "
                                                       "not renormalised.")
sqrt_missing = _with_bug("sqrt_missing", "softplus scores without the square root.")
keys_in_bias_dtype = _with_bug("keys_in_bias_dtype", "Selection keys summed in the bias's dtype (bf16).")

BUGS = {
    "groups_ignored": (groups_ignored, "models/deepseek-v3-grouped/E256-k8", "mismatch"),
    "group_max": (group_max, "models/deepseek-v3-grouped/E256-k8", "mismatch"),
    "topk_method_ignored": (topk_method_ignored, "models/deepseek-v2-grouped/E160-k6", "mismatch"),
    "always_renormalized": (always_renormalized, "models/qwen2-moe-olmoe-raw/E64-k8", "weight_error"),
    "softmax_before_topk": (softmax_before_topk, "models/gpt-oss-120b/E128-k4", "weight_error"),
    "sqrt_missing": (sqrt_missing, "models/deepseek-v4/E384-k6", "weight_error"),
    "keys_in_bias_dtype": (keys_in_bias_dtype, "models/deepseek-v3-bf16-bias/E256-k8", "mismatch"),
}
"""Bug name -> (kernel, the case it fails, a failure class validate reports there)."""
