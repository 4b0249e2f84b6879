"""Synthetic router traces with controlled shape, skew, padding, ties and bias.

Model of the logits, per layer (all draws from one seeded ``torch.Generator``, so the output
is a deterministic function of the spec):

* each token has a hidden vector ``h ~ N(0, I_16)``; each expert a direction
  ``w_e ~ N(0, I_16 / 16)``; ``logit[t, e] = offset[e] + 1.5 * h_t . w_e + 0.5 * noise``;
* the per-expert ``offset`` sets the load skew: ``uniform`` (0), ``zipf:A``
  (``-A * ln(rank_e)``, ranks a random permutation), ``hot:N:F`` (``ln F`` on N random
  experts), or ``imbalance:X[:S]`` (Gaussian offsets whose scale is searched, by bisection
  on a calibration batch of 2048 tokens, so that the layer's max/mean tokens per expert
  without bias is about a target; the target runs linearly from ``X (1 - S)`` on the first
  layer to ``X (1 + S)`` on the last, so that layers differ as in real models; S defaults
  to 0.4, ``S = 0`` gives every layer the target X);
* ``bias``: ``zero``, or ``fitted``: DeepSeek-V3's auxiliary-loss-free balancing
  (Liu et al., "DeepSeek-V3 Technical Report", 2024, sec. 2.1.2): starting from 0, for
  ``fit_steps`` batches of 1024 tokens, ``bias += u * sign(mean load - load)`` per expert;
* steps: the prefill chunks and decode steps whose batch is drawn uniformly from
  1..max_decode_batch; ``order`` ``prefill-first`` (all chunks, then the decode steps) or
  ``interleaved`` (chunk j placed before decode step ``floor(j D / C)`` of D, C chunks, as a
  server admits new requests while it decodes). ``padding``: ``graph`` pads each decode
  batch up to the next CUDA-graph size (1, 2, 4, 8, 16, 24, 32, 48, 64, ...), as vLLM pads
  decode batches for graph replay; ``none`` pads nothing; ``fraction:F`` appends padded rows
  to the decode steps (to the prefill chunks when there are no decode steps), in proportion
  to their tokens, so that padded rows / all rows = F (to rounding). Padded rows are the
  last rows of their step, marked in ``is_padding``; their logits are drawn like the others;
* ``ties``: that many unpadded rows per layer get an exact tie at the k-th boundary: the
  best unpicked expert with the same bias as the k-th pick is given the k-th pick's logit;
* ``nonfinite``: that many unpadded rows per layer get a NaN and a +inf logit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from routetool.errors import RouteToolError
from routetool.trace import LayerArrays, RouterConfig, TraceMeta, router_config_errors

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_HIDDEN = 16


@dataclass
class SynthSpec:
    """What :func:`synthesize` makes (see the module docstring for the model)."""

    num_layers: int = 4
    router: RouterConfig = field(default_factory=lambda: RouterConfig(num_experts=256, topk=8, route_scale=2.5))
    dtype: torch.dtype = torch.bfloat16
    prefill_chunks: tuple[int, ...] = (384, 128)
    decode_steps: int = 16
    max_decode_batch: int = 48
    padding: str = "graph"
    order: str = "prefill-first"
    skew: str = "imbalance:3"
    bias: str = "zero"
    bias_update_rate: float = 1e-3
    fit_steps: int = 50
    ties: int = 4
    nonfinite: int = 0
    seed: int = 0
    model: str = "synthetic"


def _parse_skew(skew: str) -> tuple[str, list[float]]:
    kind, _, rest = skew.partition(":")
    try:
        args = [float(x) for x in rest.split(":")] if rest else []
    except ValueError:
        raise RouteToolError(f"--skew {skew!r}: arguments must be numbers",
                             fix="use uniform, zipf:A, hot:N:F or imbalance:X") from None
    expected = {"uniform": (0,), "zipf": (1,), "hot": (2,), "imbalance": (1, 2)}
    if kind not in expected or len(args) not in expected[kind]:
        raise RouteToolError(f"--skew {skew!r} is not understood",
                             fix="use uniform, zipf:A, hot:N:F, imbalance:X or imbalance:X:S")
    if kind == "zipf" and args[0] < 0:
        raise RouteToolError("--skew zipf:A needs A >= 0", fix="e.g. zipf:1.1")
    if kind == "hot" and (args[0] < 1 or args[1] <= 0):
        raise RouteToolError("--skew hot:N:F needs N >= 1 and F > 0", fix="e.g. hot:8:4")
    if kind == "imbalance" and args[0] < 1:
        raise RouteToolError("--skew imbalance:X needs X >= 1 (max/mean is never below 1)", fix="e.g. imbalance:3")
    if kind == "imbalance" and len(args) == 2 and not 0 <= args[1] < 1:
        raise RouteToolError("--skew imbalance:X:S needs a spread 0 <= S < 1", fix="e.g. imbalance:3:0.4")
    return kind, args


def _parse_padding(padding: str) -> tuple[str, float]:
    kind, _, rest = padding.partition(":")
    if kind in ("graph", "none") and not rest:
        return kind, 0.0
    if kind == "fraction":
        try:
            value = float(rest)
        except ValueError:
            value = float("nan")
        if 0 <= value < 1:
            return kind, value
        raise RouteToolError(f"--padding {padding!r}: the fraction must be a number in [0, 1)", fix="e.g. fraction:0.1")
    raise RouteToolError(f"--padding {padding!r} is not understood", fix="use graph, none or fraction:F")


def check_spec(spec: SynthSpec) -> None:
    """Raise :class:`RouteToolError` for an impossible spec."""
    problems = router_config_errors(spec.router)
    if spec.num_layers < 1:
        problems.append("num_layers must be >= 1")
    if any(c < 1 for c in spec.prefill_chunks):
        problems.append("prefill chunks must be >= 1 token")
    if spec.decode_steps < 0 or spec.max_decode_batch < 1:
        problems.append("decode_steps must be >= 0 and max_decode_batch >= 1")
    if not spec.prefill_chunks and spec.decode_steps == 0:
        problems.append("no steps: give prefill chunks or decode steps")
    if spec.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        problems.append("dtype must be float32, bfloat16 or float16")
    if spec.bias not in ("zero", "fitted"):
        problems.append(f"bias {spec.bias!r} must be zero or fitted")
    if spec.ties < 0 or spec.nonfinite < 0:
        problems.append("ties and nonfinite must be >= 0")
    if spec.order not in ("prefill-first", "interleaved"):
        problems.append(f"order {spec.order!r} must be prefill-first or interleaved")
    if not (math.isfinite(spec.bias_update_rate) and spec.bias_update_rate >= 0) or spec.fit_steps < 0:
        problems.append("bias_update_rate and fit_steps must be >= 0")
    if problems:
        raise RouteToolError("; ".join(problems), fix="see `routetool synth --help`")
    _parse_skew(spec.skew)
    _parse_padding(spec.padding)


def _step_sizes(spec: SynthSpec, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """Per-step (rows, real tokens) in step order; rows - real tokens are padding."""
    kind, fraction = _parse_padding(spec.padding)
    rows, real = [], []
    for c in spec.prefill_chunks:
        rows.append(c)
        real.append(c)
    for _ in range(spec.decode_steps):
        b = int(torch.randint(1, spec.max_decode_batch + 1, (1,), generator=gen))
        padded = next((g for g in GRAPH_BATCH_SIZES if g >= b), b) if kind == "graph" else b
        rows.append(padded)
        real.append(b)
    if kind == "fraction" and fraction > 0:
        first_decode = len(spec.prefill_chunks)
        eligible = list(range(first_decode, len(real))) or list(range(len(real)))
        total_pad = round(fraction * sum(real) / (1 - fraction))
        weight = sum(real[i] for i in eligible)
        quotas = [total_pad * real[i] / weight for i in eligible]
        extra = [math.floor(q) for q in quotas]
        # largest remainder (ties to the earlier step) so that the total is exact
        by_remainder = sorted(range(len(eligible)), key=lambda j: (-(quotas[j] - extra[j]), j))
        for j in by_remainder[: total_pad - sum(extra)]:
            extra[j] += 1
        for j, i in enumerate(eligible):
            rows[i] = real[i] + extra[j]
    if spec.order == "interleaved" and spec.prefill_chunks and spec.decode_steps:
        C, D = len(spec.prefill_chunks), spec.decode_steps
        keys = [(j * D // C, 0, j) for j in range(C)] + [(d, 1, C + d) for d in range(D)]
        order = [k[2] for k in sorted(keys)]
        rows, real = [rows[i] for i in order], [real[i] for i in order]
    return rows, real


def _route_counts(logits: torch.Tensor, bias: torch.Tensor, router: RouterConfig) -> torch.Tensor:
    from kernel.reference import biased_scores, normalized_scores, select_topk

    scores = normalized_scores(logits, router.router_score_normalization, router.router_output_multiplier)
    ids = select_topk(biased_scores(scores, bias), router.topk)
    return torch.bincount(ids.flatten(), minlength=router.num_experts)


def _imbalance(counts: torch.Tensor) -> float:
    c = counts.double()
    return float(c.max() / c.mean()) if c.sum() > 0 else 0.0


def _logits(offset: torch.Tensor, dirs: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    h = torch.randn((n, _HIDDEN), generator=gen)
    noise = torch.randn((n, offset.numel()), generator=gen)
    return offset + 1.5 * (h @ dirs) + 0.5 * noise


def _offsets(kind: str, args: list[float], layer: int, spec: SynthSpec, dirs: torch.Tensor,
             gen: torch.Generator) -> torch.Tensor:
    E = spec.router.num_experts
    if kind == "uniform":
        return torch.zeros(E)
    if kind == "zipf":
        ranks = torch.randperm(E, generator=gen).double() + 1
        return (-args[0] * ranks.log()).float()
    if kind == "hot":
        n_hot = min(E, int(args[0]))
        off = torch.zeros(E)
        off[torch.randperm(E, generator=gen)[:n_hot]] = math.log(args[1])
        return off
    # imbalance:X[:S] -- Gaussian offsets, scale found by bisection on a calibration batch
    frac = layer / max(1, spec.num_layers - 1)
    spread = args[1] if len(args) > 1 else 0.4
    target = max(1.0, args[0] * ((1 - spread) + 2 * spread * frac))
    shape = torch.randn(E, generator=gen)
    calib = _logits(torch.zeros(E), dirs, 2048, gen)
    zero_bias = torch.zeros(E)
    lo, hi = 0.0, 8.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if _imbalance(_route_counts(calib + mid * shape, zero_bias, spec.router)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2 * shape


def _fit_bias(offset: torch.Tensor, dirs: torch.Tensor, spec: SynthSpec, gen: torch.Generator) -> torch.Tensor:
    bias = torch.zeros(spec.router.num_experts)
    for _ in range(spec.fit_steps):
        counts = _route_counts(_logits(offset, dirs, 1024, gen), bias, spec.router).double()
        bias += spec.bias_update_rate * torch.sign(counts.mean() - counts).float()
    return bias


def _inject_ties(logits: torch.Tensor, bias: torch.Tensor, rows: torch.Tensor, spec: SynthSpec) -> int:
    from kernel.reference import biased_scores, normalized_scores

    r = spec.router
    made = 0
    for row in rows.tolist():
        x = logits[row:row + 1]
        b = biased_scores(normalized_scores(x, r.router_score_normalization, r.router_output_multiplier), bias)[0]
        order = torch.sort(b, descending=True, stable=True).indices
        kth = int(order[r.topk - 1])
        for cand in order[r.topk:].tolist():
            if bias[cand] == bias[kth]:
                logits[row, cand] = logits[row, kth]
                made += 1
                break
    return made


def synthesize(spec: SynthSpec) -> tuple[TraceMeta, dict[int, LayerArrays]]:
    """Make a synthetic trace: metadata and per-layer tensors for :func:`write_trace`.

    Raises:
        RouteToolError: an impossible spec (see :func:`check_spec`).
    """
    check_spec(spec)
    kind, args = _parse_skew(spec.skew)
    gen = torch.Generator().manual_seed(spec.seed)
    E = spec.router.num_experts
    rows, real = _step_sizes(spec, gen)
    offsets = torch.tensor([0] + rows).cumsum(0)
    padding = torch.zeros(int(offsets[-1]), dtype=torch.bool)
    for start, n_rows, n_real in zip(offsets.tolist(), rows, real):
        padding[start + n_real:start + n_rows] = True
    unpadded = torch.nonzero(~padding).flatten()
    layers: dict[int, LayerArrays] = {}
    for layer in range(spec.num_layers):
        dirs = torch.randn((_HIDDEN, E), generator=gen) / math.sqrt(_HIDDEN)
        offset = _offsets(kind, args, layer, spec, dirs, gen)
        bias = _fit_bias(offset, dirs, spec, gen) if spec.bias == "fitted" else torch.zeros(E)
        logits = _logits(offset, dirs, int(offsets[-1]), gen).to(spec.dtype)
        special = unpadded[torch.randperm(unpadded.numel(), generator=gen)]
        n_ties = min(spec.ties, special.numel()) if spec.router.topk < E else 0
        tie_rows = special[:n_ties]
        if n_ties:
            _inject_ties(logits, bias, tie_rows, spec)
        bad_rows = special[n_ties:n_ties + spec.nonfinite]
        for row in bad_rows.tolist():
            cols = torch.randperm(E, generator=gen)[:2]
            logits[row, cols[0]] = float("nan")
            if E > 1:
                logits[row, cols[1]] = float("inf")
        layers[layer] = LayerArrays(
            gating_output=logits,
            bias=bias,
            is_padding=padding.clone(),
            step_offsets=offsets.clone(),
        )
    r = spec.router
    provenance = (
        f"routetool synth seed={spec.seed} skew={spec.skew} bias={spec.bias}"
        + (f" (u={spec.bias_update_rate:g}, {spec.fit_steps} updates)" if spec.bias == "fitted" else "")
        + f" dtype={str(spec.dtype).removeprefix('torch.')} prefill={list(spec.prefill_chunks)}"
        f" decode_steps={spec.decode_steps} max_decode_batch={spec.max_decode_batch}"
        + (f" padding={spec.padding}" if spec.padding != "graph" else "")
        + (f" order={spec.order}" if spec.order != "prefill-first" else "")
        + f" ties={spec.ties} nonfinite={spec.nonfinite}; logits are synthetic, not from a model"
    )
    meta = TraceMeta(model=spec.model, router=r, provenance=provenance, extra={"generator": "routetool.synth"})
    return meta, layers


@dataclass
class SynthLayerStats:
    """Realised statistics of one synthetic layer (what ``routetool synth`` prints).

    Attributes:
        layer: layer index. num_tokens / num_steps: rows and steps.
        padded_rows: rows marked ``is_padding``. nonfinite_rows: rows with a NaN/inf logit.
        boundary_ties: unpadded rows whose k-th and (k+1)-th biased scores are exactly equal.
        imbalance_zero_bias: max/mean tokens per expert of the unpadded rows routed without bias.
        imbalance: the same with the trace's bias (equal to the above for ``bias=zero``).
        cv: coefficient of variation (std/mean) of tokens per expert, with the bias.
        idle_experts: experts no unpadded row picks, with the bias.
        bias_abs_max: largest |bias|.
    """

    layer: int
    num_tokens: int
    num_steps: int
    padded_rows: int
    nonfinite_rows: int
    boundary_ties: int
    imbalance_zero_bias: float
    imbalance: float
    cv: float
    idle_experts: int
    bias_abs_max: float


def synth_stats(meta: TraceMeta, layers: dict[int, LayerArrays]) -> list[SynthLayerStats]:
    """Realised statistics of a synthetic trace (routing by the reference, padded rows excluded)."""
    from kernel.reference import biased_scores, normalized_scores, select_topk
    from routetool.compare import boundary_margins
    from routetool.load import expert_counts, load_stats

    r = meta.router
    out = []
    for layer, arrays in sorted(layers.items()):
        logits = arrays.gating_output
        n = int(logits.shape[0])
        pad = arrays.is_padding if arrays.is_padding is not None else torch.zeros(n, dtype=torch.bool)
        bias = arrays.bias.float() if arrays.bias is not None else torch.zeros(r.num_experts)
        scores = normalized_scores(logits, r.router_score_normalization, r.router_output_multiplier)
        biased = biased_scores(scores, bias)
        real = ~pad
        counts = expert_counts(select_topk(biased[real], r.topk), r.num_experts)
        counts0 = expert_counts(select_topk(biased_scores(scores[real], torch.zeros_like(bias)), r.topk), r.num_experts)
        stats, stats0 = load_stats(counts), load_stats(counts0)
        margins = boundary_margins(biased, r.topk, pad)
        offsets = arrays.step_offsets
        out.append(SynthLayerStats(
            layer=layer,
            num_tokens=n,
            num_steps=int(offsets.numel() - 1) if offsets is not None else 1,
            padded_rows=int(pad.sum()),
            nonfinite_rows=int((~torch.isfinite(logits.float())).any(-1).sum()),
            boundary_ties=int((margins == 0).sum()),
            imbalance_zero_bias=stats0.imbalance,
            imbalance=stats.imbalance,
            cv=stats.cv,
            idle_experts=len(stats.idle),
            bias_abs_max=float(bias.abs().max()) if bias.numel() else 0.0,
        ))
    return out
