"""PyTorch reference of the router: the definition every kernel is checked against.

Semantics (the seed kernel's, ``vllm.models.muse_spark.common.ops.fused_routing``, and the options
of production models beyond it, docs/semantics.md), per token:

1. ``x = gating_output * router_output_multiplier`` (multiplier optional), in float32.
2. ``scores``, by ``router_score_normalization``: ``sigmoid(x)``, a numerically stable
   ``softmax(x)`` over the experts, ``sqrt(softplus(x))`` (``sqrtsoftplus``, DeepSeek-V4), or
   ``x`` itself (``topk_then_softmax``, gpt-oss: the logits select, step 4 weighs).
3. Selection keys ``scores + bias``. With group-limited routing (``n_group``/``topk_group``,
   DeepSeek-V3's ``noaux_tc``) the experts split into ``n_group`` groups of consecutive ids, a
   group's score is the sum of its two best keys (its best, DeepSeek-V2's ``topk_method=
   group_limited_greedy``), the ``topk_group`` best groups are kept (equal group scores go to the
   lowest group index) and the keys of every other group are ``-inf``.
   Pick ``topk`` experts of the kept groups, one at a time by argmax over the experts not yet
   picked; equal values go to the lowest expert index (as ``tl.argmax`` does).
4. ``topk_weights = picked unbiased scores * (route_scale / (sum of them + eps))``; with
   ``norm_topk_prob=False``, ``picked scores * route_scale`` (Qwen2-MoE, OLMoE); under
   ``topk_then_softmax``, ``softmax(picked logits) * route_scale``.
5. Rows with ``is_padding`` get ``topk_ids = -1`` and ``topk_weights = 0``.

Where the seed is undefined (non-finite input, a zero denominator) this package follows
one safe rule, in the reference and in every project kernel alike, so that ids are always
valid and distinct and weights always finite:

* a NaN logit (after the multiplier) counts as ``-inf``: score 0 under sigmoid and
  sqrtsoftplus, no probability mass under softmax; a NaN biased score counts as ``-inf`` for
  selection, a NaN group score too;
* softmax over a row holding ``+inf`` gives the ``+inf`` experts equal shares of 1 and every
  other expert 0; a row of nothing but ``-inf``/NaN gets scores 0 (``topk_then_softmax``: the
  same rule over the picked logits);
* under sqrtsoftplus a ``+inf`` logit counts as the largest finite float32 (score about 1.8e19);
* when the picked scores sum to 0 (every picked sigmoid underflowed, or a row of ``-inf``),
  the weights are 0 instead of 0/0;
* ``-0.0`` and ``+0.0`` biased scores are equal (a tie, lowest index wins).

For finite input and a non-zero denominator this is exactly the seed's arithmetic.

Each function takes the router's parameters by keyword, as the kernels do (the seed's
signature, and the keywords beyond it: ``n_group``, ``topk_group``, ``topk_method``, ``norm_topk_prob``);
:func:`scores` and :func:`route` take them as one :class:`~routetool_kernels.spec.RouterSpec`.
"""

from __future__ import annotations

import torch

from routetool_kernels._launch import check_routing_args
from routetool_kernels.spec import NORMALIZATIONS, RouterSpec

FLOAT32_MAX = torch.finfo(torch.float32).max


def normalized_scores(
    gating_output: torch.Tensor,
    router_score_normalization: str = "sigmoid",
    router_output_multiplier: float | None = None,
) -> torch.Tensor:
    """Router scores before the bias: the scoring function of the (scaled) logits.

    Args:
        gating_output: ``[num_tokens, num_experts]`` float32, bfloat16 or float16 logits.
        router_score_normalization: ``"sigmoid"``, ``"softmax"`` (stable, over the experts),
            ``"sqrtsoftplus"`` (``sqrt(softplus(x))``, DeepSeek-V4) or ``"topk_then_softmax"``
            (the logits themselves: gpt-oss selects on them and softmaxes the picks,
            :func:`pick_weights`).

    Returns:
        ``[num_tokens, num_experts]`` float32 scores, never NaN: in ``[0, 1]`` for sigmoid and
        softmax, ``[0, 1.9e19]`` for sqrtsoftplus, the logits (``-inf`` for NaN) for
        topk_then_softmax (see the module docstring for the rule on non-finite logits).

    Raises:
        ValueError: an unknown ``router_score_normalization``.
    """
    # (each step after the first copy works in place: the same values, without a fresh [n, E]
    # buffer per step, whose first touch costs more than the arithmetic on a CPU)
    x = gating_output.float()
    owned = x is not gating_output  # (a copy of the logits: ours to overwrite)
    if router_output_multiplier is not None:
        x = x.mul_(router_output_multiplier) if owned else x * router_output_multiplier
        owned = True
    if router_score_normalization == "sqrtsoftplus":  # +inf -> the largest float32: a finite score
        x = _nan_to_num(x, owned, posinf=FLOAT32_MAX)
        return torch.nn.functional.softplus(x).sqrt_()
    x = _nan_to_num(x, owned, posinf=float("inf"))  # NaN -> -inf
    if router_score_normalization == "sigmoid":
        return x.sigmoid_()
    if router_score_normalization == "topk_then_softmax":
        return x
    if router_score_normalization != "softmax":
        raise ValueError(f"unknown router_score_normalization {router_score_normalization!r}")
    return softmax_rows(x)


def _nan_to_num(x: torch.Tensor, owned: bool, posinf: float) -> torch.Tensor:
    """``x`` float32 with NaN -> ``-inf`` and ``+inf`` -> ``posinf``: in place where ``owned``."""
    if owned:
        return x.nan_to_num_(nan=float("-inf"), posinf=posinf, neginf=float("-inf"))
    return torch.nan_to_num(x, nan=float("-inf"), posinf=posinf, neginf=float("-inf"))


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The stable softmax of each row of ``x`` (float32 without NaN), with the safe rule: ``+inf``
    entries share the mass equally, a row of only ``-inf`` gets 0 everywhere.

    Args:
        x: ``[n, m]`` float32, no NaN.

    Returns:
        ``[n, m]`` float32 in ``[0, 1]``.
    """
    row_max = x.amax(dim=-1, keepdim=True)
    # exp(x - max) is NaN for a +inf max and 0 everywhere for a -inf max; both are handled
    # by the rule above: +inf entries share the mass, an all -inf row gets 0.
    has_inf = torch.isposinf(row_max)
    shifted = torch.where(has_inf, 0.0, x - torch.where(torch.isfinite(row_max), row_max, 0.0))
    exp = torch.where(has_inf, torch.isposinf(x).float(), torch.exp(shifted))
    total = exp.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, exp / torch.where(total > 0, total, 1.0), 0.0)


def biased_scores(scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Selection keys ``scores + bias`` in float32, with NaN replaced by ``-inf``.

    Args:
        scores: ``[num_tokens, num_experts]`` float32 from :func:`normalized_scores`.
        bias: ``[num_experts]`` float32, bfloat16 or float16 (``e_score_correction_bias``).
    """
    biased = scores + bias.float()
    return biased.nan_to_num_(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))  # NaN -> -inf


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s device is capturing a CUDA graph on the current stream."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def select_topk(biased: torch.Tensor, topk: int) -> torch.Tensor:
    """Indices of the ``topk`` largest values per row; equal values go to the lowest index.

    The definition is a stable descending sort, which keeps equal values in index order, exactly
    what a repeated ``tl.argmax`` produces. ``torch.topk`` alone is not enough: its order among
    equal values is unspecified and differs between CPU and CUDA. So ``torch.topk`` picks the
    ``topk + 1`` largest values, the ``topk`` picks are put in (value descending, index ascending)
    order by two stable sorts of ``topk`` elements, and the rows where the ``topk``-th and
    ``topk + 1``-th values are equal (a tie at the boundary, where the set itself depends on the
    rule) take the full stable sort. The result equals the full sort's on every row. Inside a
    CUDA-graph capture the full sort runs on every row (the tied rows cannot be found there
    without a synchronisation).

    Args:
        biased: ``[num_tokens, num_experts]`` float32 without NaN.
        topk: number of experts per token.

    Returns:
        ``[num_tokens, topk]`` int64 expert ids, best first.
    """
    E = biased.shape[-1]
    if topk >= E or biased.shape[0] == 0 or _capturing(biased):
        # the definition itself; also inside a CUDA-graph capture, where finding the tied rows
        # (a data-dependent size) would synchronise
        return torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :topk]
    values, ids = torch.topk(biased, topk + 1, dim=-1, sorted=True)
    boundary_tie = values[:, topk - 1] == values[:, topk]
    values, ids = values[:, :topk], ids[:, :topk]
    by_index = torch.argsort(ids, dim=-1)
    ids, values = ids.gather(1, by_index), values.gather(1, by_index)
    ids = ids.gather(1, torch.sort(values, dim=-1, descending=True, stable=True).indices)
    rows = boundary_tie.nonzero().flatten()
    if rows.numel():
        ids[rows] = torch.sort(biased[rows], dim=-1, descending=True, stable=True).indices[:, :topk]
    return ids


def group_limited_keys(biased: torch.Tensor, n_group: int, topk_group: int,
                       topk_method: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection keys of group-limited routing (step 3 of the module docstring): the experts of
    the ``topk_group`` best of ``n_group`` groups keep their keys, every other one gets ``-inf``.

    A group is ``num_experts // n_group`` consecutive expert ids; its score is the sum of its two
    best keys (its one key, for groups of one expert), a NaN sum (``inf + -inf``) counting as
    ``-inf``, or with ``topk_method="group_limited_greedy"`` its best key (DeepSeek-V2's
    ``MoEGate``); the best groups by :func:`select_topk` (equal scores: the lowest group index).
    Source: DeepSeek-V3's ``noaux_tc`` gate (``MoEGate`` of its Hugging Face code, vLLM's
    ``grouped_topk``), whose masked keys are ``-inf`` as here (the Hugging Face model's are 0.0,
    which differs where a kept key is negative).

    Args:
        biased: ``[n, E]`` float32 keys without NaN (:func:`biased_scores`), ``E % n_group == 0``.
        n_group / topk_group: the groups, and those a token may pick from.

    Returns:
        ``(keys, columns)``: ``[n, E]`` float32 keys, ``-inf`` outside the kept groups; and
        ``[n, topk_group * E // n_group]`` int64, the kept groups' expert ids in ascending order.
    """
    n, E = biased.shape
    per = E // n_group
    grouped = biased.view(n, n_group, per)
    best = 1 if topk_method == "group_limited_greedy" else min(2, per)
    group_scores = grouped.topk(best, dim=-1).values.sum(-1).nan_to_num_(nan=float("-inf"))
    kept = select_topk(group_scores, topk_group).sort(dim=-1).values  # [n, topk_group] ascending
    columns = (kept[:, :, None] * per + torch.arange(per, device=biased.device)).reshape(n, -1)
    keys = torch.full_like(biased, float("-inf")).scatter_(1, columns, biased.gather(1, columns))
    return keys, columns


def select_grouped(biased: torch.Tensor, topk: int, n_group: int | None = None, topk_group: int | None = None,
                   topk_method: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3 of the module docstring: ``(ids, keys)``, the ``topk`` picks (``[n, topk]`` int64,
    best first) and the keys they were picked by (``[n, E]`` float32: ``biased``, or with grouping
    set, :func:`group_limited_keys`'). With grouping the picks are made among the kept groups'
    experts only, in expert-id order, so that a row whose kept keys are all ``-inf`` still picks
    inside its groups."""
    if n_group is None:
        return select_topk(biased, topk), biased
    keys, columns = group_limited_keys(biased, n_group, topk_group, topk_method)
    return columns.gather(1, select_topk(biased.gather(1, columns), topk)), keys


def select(biased: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_grouped` with ``spec``'s ``topk`` and grouping: ``(ids, keys)``, the picks
    (``[n, topk]`` int64, best first) and the keys they were picked by (``-inf`` outside the kept
    groups). For callers that compute the keys themselves (synth)."""
    return select_grouped(biased, spec.topk, spec.n_group, spec.topk_group, spec.topk_method)


def kth_key(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The ``K``-th largest selection key of each row, read off the router's own picks: the key of
    its last pick, since the picks come best first (a plain top-k of ``keys`` gives the same value,
    ties included, without a second selection).

    Args:
        keys: ``[n, E]`` float32, the keys :func:`routing_with_scores` returns (``biased``).
        ids: ``[n, K]`` int, the picks it returned with them (a padded row's -1 reads expert 0:
            callers mask such rows).

    Returns:
        ``[n, 1]`` float32.
    """
    return keys.gather(1, ids[:, -1:].long().clamp_min(0))


def selection_keys(biased: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """The keys ``spec`` selects by from ``biased`` (``[n, E]`` float32 without NaN): ``biased``
    itself, or with grouping set, ``-inf`` outside the kept groups (:func:`group_limited_keys`),
    so that a plain top-k of them picks as the router does (up to ties)."""
    if spec.n_group is None:
        return biased
    return group_limited_keys(biased, spec.n_group, spec.topk_group, spec.topk_method)[0]


def musespark1x_routing_reference(
    gating_output: torch.Tensor,
    bias: torch.Tensor,
    topk: int,
    route_scale: float,
    router_output_multiplier: float | None = None,
    router_score_normalization: str = "sigmoid",
    router_score_division_eps: float | None = None,
    topk_weights: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    *,
    is_padding: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    topk_method: str | None = None,
    norm_topk_prob: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router in plain PyTorch (any device), same signature as the kernels, and the keywords
    of the semantics beyond the seed's: a ``--kernel`` (``routetool_kernels.reference:
    musespark1x_routing_reference``) for traces whose semantics the MuseSpark1x kernels reject.

    Args:
        gating_output: ``[num_tokens, num_experts]`` float32, bfloat16 or float16 router
            logits; any strides.
        bias: ``[num_experts]`` per-expert selection bias (``e_score_correction_bias``).
        topk: experts per token, ``1 <= topk <= num_experts``.
        route_scale: factor on the weights (``routed_scaling_factor``), > 0.
        router_output_multiplier: optional factor on the logits before normalization.
        router_score_normalization: the scoring function (``sigmoid``, ``softmax``,
            ``sqrtsoftplus``, ``topk_then_softmax``).
        router_score_division_eps: optional non-negative term added to the denominator.
        topk_weights / topk_ids: optional caller buffers (float32; int32 or int64), at least
            ``[num_tokens, topk]``: the outputs are written into their ``[num_tokens, topk]`` views.
        is_padding: optional ``[num_tokens]`` bool; padded rows get id -1 and weight 0.
        n_group / topk_group: group-limited routing, or None (off).
        topk_method: how groups are scored: None or ``noaux_tc`` (top-2 sum), ``group_limited_greedy`` (best).
        norm_topk_prob: False: weights not renormalised; None or True: renormalised.

    Returns:
        ``(topk_weights, topk_ids)``: ``[num_tokens, topk]`` float32 and int32 (or the buffers'
        views), best first.

    Raises:
        ValueError: the same argument errors as the kernels' launchers, and an impossible
            router (:meth:`~routetool_kernels.spec.RouterSpec.problems`).
    """
    weights, ids, _, _ = routing_with_scores(
        gating_output, bias, topk, route_scale, router_output_multiplier, router_score_normalization,
        router_score_division_eps, is_padding=is_padding, n_group=n_group, topk_group=topk_group,
        topk_method=topk_method, norm_topk_prob=norm_topk_prob)
    if topk_weights is None and topk_ids is None:
        return weights, ids
    launch = check_routing_args(gating_output, bias, topk, route_scale, router_output_multiplier,
                                router_score_normalization, router_score_division_eps, topk_weights, topk_ids,
                                is_padding, normalizations=NORMALIZATIONS)
    launch.topk_weights.copy_(weights)
    launch.topk_ids.copy_(ids)
    return launch.topk_weights, launch.topk_ids


def routing_with_scores(
    gating_output: torch.Tensor,
    bias: torch.Tensor,
    topk: int,
    route_scale: float,
    router_output_multiplier: float | None = None,
    router_score_normalization: str = "sigmoid",
    router_score_division_eps: float | None = None,
    *,
    is_padding: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    topk_method: str | None = None,
    norm_topk_prob: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`musespark1x_routing_reference` (same arguments and errors), returning also the
    scores it selected by, for callers that compare against them (replay, validate):
    ``(topk_weights, topk_ids, scores, biased)``, the last two ``[num_tokens, num_experts]``
    float32 from :func:`normalized_scores` and the selection keys (:func:`biased_scores`, ``-inf``
    outside the kept groups with grouping set: :func:`group_limited_keys`)."""
    launch = check_routing_args(
        gating_output, bias, topk, route_scale, router_output_multiplier,
        router_score_normalization, router_score_division_eps, None, None, is_padding, normalizations=NORMALIZATIONS,
    )
    spec = RouterSpec(num_experts=launch.num_experts, topk=topk, route_scale=launch.route_scale,
                      router_score_normalization=router_score_normalization,
                      router_score_division_eps=launch.router_score_division_eps,
                      n_group=n_group, topk_group=topk_group, topk_method=topk_method,
                      norm_topk_prob=norm_topk_prob)
    problems = spec.problems()
    if problems:
        raise ValueError("; ".join(problems))
    scores = normalized_scores(gating_output, router_score_normalization, launch.router_output_multiplier)
    ids, biased = select(biased_scores(scores, bias), spec)
    weights = pick_weights(scores, ids, spec)
    ids = ids.to(torch.int32)
    if is_padding is not None:
        pad = is_padding[:, None]
        ids = torch.where(pad, -1, ids)
        weights = torch.where(pad, 0.0, weights)
    return weights, ids, scores, biased


def _supported(spec: RouterSpec) -> RouterSpec:
    """``spec``, when the reference defines its routing.

    Raises:
        NotImplementedError: a field the reference does not route (:meth:`RouterSpec.unsupported`; none today).
    """
    why = spec.unsupported()
    if why:
        raise NotImplementedError(why)
    return spec


def scores(gating_output: torch.Tensor, spec: RouterSpec, *, finite_inplace: bool = False) -> torch.Tensor:
    """:func:`normalized_scores` with ``spec``'s normalization and multiplier.

    Args:
        gating_output: ``[num_tokens, num_experts]`` float32, bfloat16 or float16 logits.
        spec: the router.
        finite_inplace: the logits are float32 and finite, and may be overwritten: sigmoid
            scores are computed in place, without the copies the rule for non-finite logits
            needs (a large batch's memory; the same values).

    Returns:
        ``[num_tokens, num_experts]`` float32 scores (:func:`normalized_scores`).

    Raises:
        NotImplementedError: :meth:`RouterSpec.unsupported`.
        ValueError: an unknown normalization.
    """
    spec = _supported(spec)
    if finite_inplace and spec.router_score_normalization == "sigmoid":
        x = gating_output if spec.router_output_multiplier is None else gating_output.mul_(spec.router_output_multiplier)
        return torch.sigmoid_(x)
    return normalized_scores(gating_output, spec.router_score_normalization, spec.router_output_multiplier)


def weight_sum(spec: RouterSpec) -> float | None:
    """What a row's weights sum to under ``spec`` when some picked score is > 0: ``route_scale``
    (the weights are renormalised, or a softmax over the picks); None with
    ``router_score_division_eps`` set (the eps makes the sum smaller, by an amount that depends on
    the row) or ``norm_topk_prob=False`` (the raw scores)."""
    if spec.router_score_division_eps is not None or spec.norm_topk_prob is False:
        return None
    return spec.route_scale


def pick_weights(scores: torch.Tensor, ids: torch.Tensor, spec: RouterSpec, *, renormalized: bool = True
                 ) -> torch.Tensor:
    """The weights a row's picks ``ids`` carry under ``spec`` (step 4 of the module docstring,
    docs/semantics.md): a row's weights judged against its own picks, whichever experts they are.

    Args:
        scores: ``[n, E]`` float32 unbiased scores (:func:`scores`).
        ids: ``[n, K]`` int picks (out-of-range ids, e.g. the -1 of padded rows, read expert 0:
            callers mask such rows).
        spec: the router (its ``route_scale``, ``router_score_division_eps``, ``norm_topk_prob``
            and scoring function).
        renormalized: the weights of ``spec``: ``route_scale * s / (sum of the row's picked s + eps)``
            (0 where that denominator is 0), ``route_scale * s`` with ``norm_topk_prob=False``,
            ``route_scale * softmax(picked logits)`` under ``topk_then_softmax``; False:
            ``route_scale * s``, the raw top-k scores some engines record
            (``weights_semantics=unnormalized``; under ``topk_then_softmax``, a softmax over every
            expert, the scores such an engine computes).

    Returns:
        ``[n, K]`` float32, position by position with ``ids``.
    """
    safe = ids.long().clamp(0, max(0, scores.shape[1] - 1))
    softmax_of_picks = spec.router_score_normalization == "topk_then_softmax"
    if softmax_of_picks and not renormalized:
        return softmax_rows(scores).gather(1, safe) * spec.route_scale
    picked = scores.gather(1, safe)
    if softmax_of_picks:
        return softmax_rows(picked) * spec.route_scale
    if not renormalized or spec.norm_topk_prob is False:
        return picked * spec.route_scale
    denom = picked.sum(-1, keepdim=True)
    if spec.router_score_division_eps is not None:
        denom = denom + spec.router_score_division_eps
    return torch.where(denom > 0, picked * (spec.route_scale / torch.where(denom > 0, denom, 1.0)), 0.0)


def route(gating_output: torch.Tensor, bias: torch.Tensor, spec: RouterSpec, *,
          is_padding: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`routing_with_scores` with the parameters of ``spec``:
    ``(topk_weights, topk_ids, scores, biased)``.

    Args:
        gating_output: ``[num_tokens, num_experts]`` logits, ``num_experts == spec.num_experts``.
        bias: ``[num_experts]``. spec: the router. is_padding: ``[num_tokens]`` bool or None.

    Returns:
        ``[num_tokens, topk]`` float32 weights and int32 ids, and ``[num_tokens, num_experts]``
        float32 scores and selection keys.

    Raises:
        NotImplementedError: :meth:`RouterSpec.unsupported`.
        ValueError: the launchers' argument errors, or ``gating_output`` not of ``spec.num_experts`` columns.
    """
    spec = _supported(spec)
    if gating_output.dim() == 2 and gating_output.shape[1] != spec.num_experts:
        raise ValueError(f"gating_output has {gating_output.shape[1]} experts (columns); the router has "
                         f"num_experts={spec.num_experts}")
    return routing_with_scores(gating_output, bias, is_padding=is_padding, **spec.kernel_kwargs())
