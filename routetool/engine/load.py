"""Expert-load histograms and their imbalance statistics."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert.

    Args:
        topk_ids: ``[n, K]`` int ids; entries outside ``[0, num_experts)`` (the -1 of
            padded rows, or invalid ids) are not counted.
        num_experts: E.

    Returns:
        ``[E]`` int64 counts on ``topk_ids``' device (``torch.bincount``).
    """
    flat = topk_ids.reshape(-1).long()
    flat = flat[(flat >= 0) & (flat < num_experts)]
    return torch.bincount(flat, minlength=num_experts)


@dataclass
class LoadStats:
    """Summary of one expert-load histogram.

    Attributes:
        assignments: total (token, expert) assignments counted.
        max_load / mean_load: tokens on the busiest expert / per expert on average.
        imbalance: max_load / mean_load (1.0 = perfectly even).
        cv: coefficient of variation, population std / mean.
        normalized_entropy: entropy of the load distribution / log(E) (1.0 = even).
        gini: Gini coefficient of the per-expert loads (0 = even, -> 1 = one expert).
        The four ratios are None when nothing was routed (no assignments: a load
        distribution with mean 0 has none of them; 0 would read as a perfectly even load).
        hottest: ``(expert, tokens)`` of the most loaded experts, busiest first.
        idle: experts that received no token.
    """

    num_experts: int
    assignments: int
    max_load: int
    mean_load: float
    imbalance: float | None
    cv: float | None
    normalized_entropy: float | None
    gini: float | None
    hottest: list[tuple[int, int]]
    idle: list[int]


def load_stats(counts: torch.Tensor, top_n: int = 5) -> LoadStats:
    """Statistics of a ``[E]`` histogram of tokens per expert (see :class:`LoadStats`)."""
    c = counts.detach().to("cpu", torch.float64)
    E = int(c.numel())
    total = float(c.sum())
    mean = total / E if E else 0.0
    max_load = float(c.max()) if E else 0.0
    if total > 0:
        p = c / total
        nz = p[p > 0]
        entropy = float(-(nz * nz.log()).sum())
        norm_entropy = entropy / torch.log(torch.tensor(float(E))).item() if E > 1 else 1.0
        s = c.sort().values
        ranks = torch.arange(1, E + 1, dtype=torch.float64)
        gini = float(((2 * ranks - E - 1) * s).sum() / (E * s.sum()))
        cv = float(c.std(unbiased=False) / mean)
        imbalance = max_load / mean
    else:
        norm_entropy = gini = cv = imbalance = None
    order = torch.argsort(-c, stable=True)[: min(top_n, E)]
    return LoadStats(
        num_experts=E,
        assignments=int(total),
        max_load=int(max_load),
        mean_load=mean,
        imbalance=imbalance,
        cv=cv,
        normalized_entropy=norm_entropy,
        gini=gini,
        hottest=[(int(e), int(c[e])) for e in order.tolist() if c[e] > 0],
        idle=[int(e) for e in torch.nonzero(c == 0).flatten().tolist()],
    )
