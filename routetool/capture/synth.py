"""Synthetic router traces with controlled shape, skew, padding, ties and bias.

Model of the logits, per layer (all draws from one seeded ``torch.Generator``, so the output
is a deterministic function of the spec):

* each token has a hidden vector ``h ~ N(0, I_16)``; each expert a direction
  ``w_e ~ N(0, I_16 / 16)``; ``logit[t, e] = offset[e] + a * h_t . w_e + 0.5 * noise``
  with the token-expert *affinity* ``a`` (1.5 unless ``affinity`` says otherwise or an
  imbalance target below the model's unskewed level lowers it, see below). Experts whose
  direction is longer are picked more often, so even without offsets the load is uneven:
  at 256 experts, top-8 and ``a = 1.5`` max/mean tokens per expert is about 3-4; at
  ``a = 0`` only sampling noise is left (about 1.4 at 2048 tokens);
* the per-expert ``offset`` sets the load skew: ``uniform`` (0), ``zipf:A``
  (``-A * ln(rank_e)``, ranks a random permutation), ``hot:N:F`` (``ln F`` on N random
  experts), or ``imbalance:X[:S]``: a per-layer target max/mean tokens per expert without
  bias, running linearly from ``X (1 - S)`` on the first layer to ``X (1 + S)`` on the last
  (S defaults to 0.4; ``S = 0`` gives every layer X, and a single layer gets X), met on a calibration batch of 2048
  tokens by bisection: above the unskewed level, on the scale of Gaussian offsets (``a``
  stays 1.5); below it, with zero offsets, on the affinity ``a`` in [0, 1.5] (only when
  ``affinity`` is None, "auto"). A target below what ``a = 0`` gives (sampling noise) or
  above what the largest offsets give cannot be met: the layer gets the nearest level and
  :func:`synth_warnings` says so;
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
  best unpicked expert with the same bias as the k-th pick is given the k-th pick's logit
  (more than a layer's unpadded rows is refused, and any at all when topk == experts: there
  is no k-th boundary to tie at);
* ``nonfinite``: that many unpadded rows per layer get a NaN and a +inf logit (rows other
  than the tie rows: more than the unpadded rows left is refused).

With ``token_seed`` set, the traffic (step sizes, the tokens' logits, the tie and non-finite
rows) is drawn from a generator of its own and the model (directions, offsets, bias) from
``seed``: the data-parallel ranks of one deployment (``routetool synth --ranks``) share one
model and see different tokens.

Limits (checked before any work, :data:`LIMITS`): the trace is built in memory, so a layer
holds at most ``2**28`` logits (rows x experts) and the trace at most ``2**30``; at most
65,536 experts and 1,024 layers; the work (layers x experts x (2 x rows + calibration and
bias-fit tokens)) at most ``2**34`` logit evaluations, a few minutes on two cores.
"""

from __future__ import annotations

import re

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from routetool.errors import RouteToolError
from routetool.numtext import number_problem
from routetool.io.trace import LayerArrays, RouterConfig, TraceMeta, router_config_errors
from routetool_kernels.spec import MUSESPARK1X

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
DEFAULT_TIES = 4
"""Tie rows per layer unless asked otherwise (``routetool synth`` lowers this default to what a
layer can hold, :func:`with_default_ties`)."""
_HIDDEN = 16
DEFAULT_AFFINITY = 1.5
"""Token-expert affinity ``a`` of the logit model unless an imbalance target lowers it."""
CALIBRATION_TOKENS = 2048
"""Tokens of the calibration batch of ``imbalance:X`` targets."""
_OFFSET_ITERS = 30
_AFFINITY_ITERS = 20
_OFFSET_SCALE_MAX = 8.0
_OFFSET_SCALE_EXTENDED = 64.0
_FIT_TOKENS = 1024
_REACHED_TOLERANCE = 0.1
STATS_BLOCK_ELEMENTS = 2**22
"""Logits per block of rows in :func:`synth_stats` (bounds its memory)."""

MAX_SEED = 2**63 - 1
MAX_EXPERTS = 1 << 16
MAX_LAYERS = 1024
MAX_PREFILL_CHUNKS = 100_000
MAX_DECODE_STEPS = 1_000_000
MAX_DECODE_BATCH = 1 << 20
MAX_SPECIAL_ROWS = 100_000
MAX_FIT_STEPS = 10_000
MAX_BIAS_RATE = 1.0
MAX_AFFINITY = 10.0
MAX_ZIPF = 100.0
MAX_HOT_FACTOR = 1e6
MAX_LAYER_ELEMENTS = 2**28
MAX_TRACE_ELEMENTS = 2**30
MAX_WORK = 2**34

LIMITS = {
    "seed": "0..2**63-1",
    "experts": f"1..{MAX_EXPERTS:,}",
    "layers": f"1..{MAX_LAYERS:,}",
    "prefill chunks": f"at most {MAX_PREFILL_CHUNKS:,}",
    "decode steps": f"0..{MAX_DECODE_STEPS:,}",
    "max decode batch": f"1..{MAX_DECODE_BATCH:,}",
    "ties, nonfinite": f"0..{MAX_SPECIAL_ROWS:,} rows per layer",
    "fit steps": f"0..{MAX_FIT_STEPS:,}",
    "bias rate": f"0..{MAX_BIAS_RATE:g}",
    "affinity": f"0..{MAX_AFFINITY:g}",
    "logits per layer": "rows x experts <= 2**28",
    "logits per trace": "layers x rows x experts <= 2**30",
    "work": "layers x experts x (2 x rows + calibration + bias-fit tokens) <= 2**34",
}
"""The documented ranges of :class:`SynthSpec` (see the module docstring)."""


@dataclass
class SynthSpec:
    """What :func:`synthesize` makes (see the module docstring for the model).

    ``affinity``: the token-expert affinity ``a``; None ("auto") is 1.5, lowered on layers
    whose ``imbalance:X`` target is below the level 1.5 gives; a number fixes it on every
    layer (1.5 reproduces traces made before the automatic lowering existed). ``token_seed``:
    draw the traffic from a generator of its own (None: from ``seed``, with the model).
    """

    num_layers: int = 4
    router: RouterConfig = MUSESPARK1X
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
    ties: int = DEFAULT_TIES
    nonfinite: int = 0
    seed: int = 0
    model: str = "synthetic"
    affinity: float | None = None
    token_seed: int | None = None


@dataclass
class LayerCalibration:
    """How one layer's logit model was set (returned by :func:`generate`).

    Attributes:
        layer: layer index. affinity: the token-expert affinity ``a`` used.
        offset_scale: scale of the Gaussian offsets (``imbalance`` skew), else None.
        target: the layer's max/mean target (``imbalance`` skew), else None.
        calibrated: max/mean reached on the calibration batch (2048 tokens, no bias),
            for ``imbalance`` targets, else None.
        reached: whether ``calibrated`` is within 10 % of ``target`` (True without a target).
    """

    layer: int
    affinity: float
    offset_scale: float | None = None
    target: float | None = None
    calibrated: float | None = None
    reached: bool = True


@dataclass
class SynthResult:
    """What :func:`generate` returns: metadata, per-layer tensors, per-layer calibration."""

    meta: TraceMeta
    layers: dict[int, LayerArrays]
    calibration: list[LayerCalibration]


def _with_options(problem: str) -> str:
    """A router problem with the synth options of the fields it names, e.g. ``n_group and topk_group
    must be set together (--n-group, --topk-group)``."""
    from routetool_kernels.spec import FIELD_INFO

    named = [info["option"] for name, info in FIELD_INFO.items() if re.search(rf"\b{name}\b", problem)]
    return f"{problem} ({', '.join(named)})" if named and not problem.endswith(")") else problem


def _bad(message: str, fix: str = "see `routetool synth --help`") -> RouteToolError:
    return RouteToolError(message, fix=fix)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_skew(skew: str, router: RouterConfig | None = None) -> tuple[str, list[float]]:
    kind, _, rest = str(skew).partition(":")
    texts = rest.split(":") if rest else []
    problem = next((p for p in map(number_problem, texts) if p), "")
    if problem:  # float() reads other scripts' digits, underscores and spaces
        raise RouteToolError(f"--skew {skew!r}: {problem}", fix="e.g. zipf:1.1, hot:8:4 or imbalance:3")
    try:
        args = [float(x) for x in texts]
    except ValueError:
        raise RouteToolError(f"--skew {skew!r}: arguments must be numbers",
                             fix="use uniform, zipf:A, hot:N:F or imbalance:X") from None
    expected = {"uniform": (0,), "zipf": (1,), "hot": (2,), "imbalance": (1, 2)}
    if kind not in expected or len(args) not in expected[kind]:
        raise RouteToolError(f"--skew {skew!r} is not understood",
                             fix="use uniform, zipf:A, hot:N:F, imbalance:X or imbalance:X:S")
    if not all(math.isfinite(a) for a in args):
        raise RouteToolError(f"--skew {skew!r}: arguments must be finite numbers (not nan or inf)",
                             fix="e.g. zipf:1.1, hot:8:4 or imbalance:3")
    if kind == "zipf" and not 0 <= args[0] <= MAX_ZIPF:
        raise RouteToolError(f"--skew zipf:A needs 0 <= A <= {MAX_ZIPF:g}", fix="e.g. zipf:1.1")
    if kind == "hot":
        n, factor = args
        if n != int(n) or n < 1 or not 0 < factor <= MAX_HOT_FACTOR:
            raise RouteToolError(f"--skew hot:N:F needs an integer N >= 1 and 0 < F <= {MAX_HOT_FACTOR:g}",
                                 fix="e.g. hot:8:4")
        if router is not None and n > router.num_experts:
            raise RouteToolError(f"--skew hot:N:F: N={int(n)} is more than the {router.num_experts} experts",
                                 fix="choose N <= --experts")
    if kind == "imbalance":
        if args[0] < 1:
            raise RouteToolError("--skew imbalance:X needs X >= 1 (max/mean is never below 1)", fix="e.g. imbalance:3")
        if len(args) == 2 and not 0 <= args[1] < 1:
            raise RouteToolError("--skew imbalance:X:S needs a spread 0 <= S < 1", fix="e.g. imbalance:3:0.4")
        if router is not None:
            most = router.num_experts / router.topk
            if args[0] > most:
                raise RouteToolError(
                    f"--skew imbalance:{args[0]:g}: max/mean tokens per expert is at most experts/topk = {most:g} "
                    "(every token on the same experts)",
                    fix=f"pass --skew imbalance:X with X <= {most:g} or --skew uniform (the default skew is imbalance:3)")
    return kind, args


def _parse_padding(padding: str) -> tuple[str, float]:
    kind, _, rest = str(padding).partition(":")
    if kind in ("graph", "none") and not rest:
        return kind, 0.0
    if kind == "fraction":
        problem = number_problem(rest)
        if problem:  # float() reads other scripts' digits, underscores and spaces
            raise RouteToolError(f"--padding {padding!r}: {problem}", fix="e.g. fraction:0.1")
        try:
            value = float(rest)
        except ValueError:
            value = float("nan")
        if 0 <= value < 1:
            return kind, value
        raise RouteToolError(f"--padding {padding!r}: the fraction must be a number in [0, 1)", fix="e.g. fraction:0.1")
    raise RouteToolError(f"--padding {padding!r} is not understood", fix="use graph, none or fraction:F")


def check_spec(spec: SynthSpec) -> None:
    """Raise :class:`RouteToolError` for an impossible spec or one outside :data:`LIMITS`
    (the sizes that depend on the drawn decode batches are checked by :func:`plan_steps`)."""
    if not isinstance(spec.router, RouterConfig):
        raise _bad("router must be a RouterConfig")
    ints = {"num_layers": spec.num_layers, "decode_steps": spec.decode_steps,
            "max_decode_batch": spec.max_decode_batch, "fit_steps": spec.fit_steps, "ties": spec.ties,
            "nonfinite": spec.nonfinite, "seed": spec.seed, "num_experts": spec.router.num_experts,
            "topk": spec.router.topk}
    wrong = [k for k, v in ints.items() if not _is_int(v)]
    if wrong or not all(_is_int(c) for c in spec.prefill_chunks):
        raise _bad(f"{', '.join(wrong) or 'prefill chunks'} must be integers")
    problems = [_with_options(problem) for problem in router_config_errors(spec.router)]
    if spec.router.router_output_multiplier == 0:
        problems.append("router_output_multiplier=0 (--multiplier) makes every logit 0 and every score equal: each row "
                        "ties all experts, so no skew can be made; leave --multiplier out, or give it a non-zero value")
    if spec.router.num_experts > MAX_EXPERTS:
        problems.append(f"num_experts={spec.router.num_experts:,} (--experts) is above the limit {MAX_EXPERTS:,}")
    if not 1 <= spec.num_layers <= MAX_LAYERS:
        problems.append(f"num_layers={spec.num_layers:,} (--layers) must be in [1, {MAX_LAYERS:,}]")
    if any(c < 1 for c in spec.prefill_chunks):
        problems.append("prefill chunks must be >= 1 token")
    if len(spec.prefill_chunks) > MAX_PREFILL_CHUNKS:
        problems.append(f"{len(spec.prefill_chunks):,} prefill chunks is above the limit {MAX_PREFILL_CHUNKS:,}")
    if spec.decode_steps < 0 or spec.max_decode_batch < 1:
        problems.append("decode_steps must be >= 0 and max_decode_batch >= 1")
    if spec.decode_steps > MAX_DECODE_STEPS:
        problems.append(f"decode_steps={spec.decode_steps:,} (--decode-steps) is above the limit {MAX_DECODE_STEPS:,}")
    if spec.max_decode_batch > MAX_DECODE_BATCH:
        problems.append(f"max_decode_batch={spec.max_decode_batch:,} (--max-decode-batch) is above the limit "
                        f"{MAX_DECODE_BATCH:,}")
    if not spec.prefill_chunks and spec.decode_steps == 0:
        problems.append("no steps: give prefill chunks or decode steps")
    if spec.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        problems.append("dtype must be float32, bfloat16 or float16")
    if spec.bias not in ("zero", "fitted"):
        problems.append(f"bias {spec.bias!r} must be zero or fitted")
    if not (0 <= spec.ties <= MAX_SPECIAL_ROWS and 0 <= spec.nonfinite <= MAX_SPECIAL_ROWS):
        problems.append(f"ties and nonfinite (--ties, --nonfinite) must be in [0, {MAX_SPECIAL_ROWS:,}] rows per layer")
    if spec.order not in ("prefill-first", "interleaved"):
        problems.append(f"order {spec.order!r} must be prefill-first or interleaved")
    rate = spec.bias_update_rate
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and 0 <= rate <= MAX_BIAS_RATE):
        problems.append(f"bias_update_rate={rate} (--bias-rate) must be a finite number in [0, {MAX_BIAS_RATE:g}]")
    if not 0 <= spec.fit_steps <= MAX_FIT_STEPS:
        problems.append(f"fit_steps={spec.fit_steps:,} (--fit-steps) must be in [0, {MAX_FIT_STEPS:,}]")
    if not 0 <= spec.seed <= MAX_SEED:
        problems.append(f"seed={spec.seed} (--seed) must be in [0, 2**63-1]")
    a = spec.affinity
    if a is not None and not (isinstance(a, (int, float)) and math.isfinite(a) and 0 <= a <= MAX_AFFINITY):
        problems.append(f"affinity={a} (--affinity) must be a finite number in [0, {MAX_AFFINITY:g}] (or None: auto)")
    if problems:
        raise _bad("; ".join(problems))
    _parse_skew(spec.skew, spec.router)
    _parse_padding(spec.padding)


def _step_sizes(spec: SynthSpec, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """Per-step (rows, real tokens) in step order; rows - real tokens are padding."""
    kind, fraction = _parse_padding(spec.padding)
    rows, real = [], []
    for c in spec.prefill_chunks:
        rows.append(c)
        real.append(c)
    if spec.decode_steps:
        # one draw of D values is the same sequence as D draws of one value
        batches = torch.randint(1, spec.max_decode_batch + 1, (spec.decode_steps,), generator=gen).tolist()
        for b in batches:
            padded = next((g for g in GRAPH_BATCH_SIZES if g >= b), b) if kind == "graph" else b
            rows.append(padded)
            real.append(b)
    if kind == "fraction" and fraction > 0:
        first_decode = len(spec.prefill_chunks)
        eligible = list(range(first_decode, len(real))) or list(range(len(real)))
        total_pad = round(fraction * sum(real) / (1 - fraction))
        _check_rows(spec, sum(real) + total_pad)
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


def _check_rows(spec: SynthSpec, num_rows: int) -> None:
    E, L = spec.router.num_experts, spec.num_layers
    fix = "lower --prefill, --decode-steps, --max-decode-batch, the padding fraction, --experts or --layers"
    if num_rows * E > MAX_LAYER_ELEMENTS:
        raise _bad(f"a layer would hold {num_rows:,} rows x {E:,} experts = {num_rows * E:,} logits; the limit is "
                   f"2**28 = {MAX_LAYER_ELEMENTS:,} per layer (the trace is built in memory)", fix=fix)
    if num_rows * E * L > MAX_TRACE_ELEMENTS:
        raise _bad(f"the trace would hold {L:,} layers x {num_rows:,} rows x {E:,} experts = {num_rows * E * L:,} "
                   f"logits; the limit is 2**30 = {MAX_TRACE_ELEMENTS:,} (the trace is built in memory)", fix=fix)


def _tie_capacity(spec: SynthSpec, unpadded: int) -> int:
    """Tie rows a layer of ``unpadded`` unpadded rows can hold: each of them, unless
    topk == experts (every expert is picked: there is no k-th boundary to tie at)."""
    return unpadded if spec.router.topk < spec.router.num_experts else 0


def _too_many_rows(option: str, asked: int, unpadded: int, available: int, made: str, taken: str = "",
                   also: str = "") -> RouteToolError:
    """The one-line refusal of ``--ties`` / ``--nonfinite`` asking for more rows than a layer has for them."""
    return _bad(f"{option} {asked:,}: a layer has {unpadded:,} unpadded row{'s' if unpadded != 1 else ''}{taken}, "
                f"so only {available:,} can be {made}",
                fix=f"pass {option} {available:,} or fewer{also}, or make more rows (--prefill, --decode-steps, "
                    "--max-decode-batch)")


def _check_special_rows(spec: SynthSpec, unpadded: int) -> None:
    """The tie rows and then the ``nonfinite`` rows are drawn from a layer's ``unpadded`` rows
    (as :func:`generate` picks them): refuse more than there are, instead of making fewer."""
    r = spec.router
    if spec.ties and r.topk >= r.num_experts:
        raise _bad(f"--ties {spec.ties:,}: topk {r.topk} = experts {r.num_experts}, so every expert is picked and no "
                   "row can be given a tie at the k-th boundary",
                   fix="pass --ties 0, or choose more experts than topk")
    if spec.ties > unpadded:
        raise _too_many_rows("--ties", spec.ties, unpadded, unpadded, "given a tie at the k-th boundary")
    available = unpadded - spec.ties
    if spec.nonfinite > available:
        raise _too_many_rows("--nonfinite", spec.nonfinite, unpadded, available, "made non-finite",
                             taken=f", {spec.ties:,} of them taken by --ties {spec.ties:,}" if spec.ties else "",
                             also=", lower --ties" if spec.ties else "")


def _layer_work(spec: SynthSpec, num_rows: int) -> tuple[int, int, int, int]:
    """Work units (logits evaluated) of one layer: (generation, calibration, bias fit, statistics)."""
    E = spec.router.num_experts
    calib = CALIBRATION_TOKENS * E * (_OFFSET_ITERS + _AFFINITY_ITERS + 2) if spec.skew.startswith("imbalance") else 0
    fit = _FIT_TOKENS * E * spec.fit_steps if spec.bias == "fitted" else 0
    return num_rows * E, calib, fit, num_rows * E


def _token_seed(spec: SynthSpec) -> int:
    return spec.seed if spec.token_seed is None else spec.token_seed


def plan_steps(spec: SynthSpec) -> tuple[list[int], list[int]]:
    """Check ``spec`` (:func:`check_spec` and the size limits) and return the per-step
    ``(rows, real tokens)`` the trace will have, without generating anything.

    Raises:
        RouteToolError: an impossible spec or one above :data:`LIMITS`.
    """
    check_spec(spec)
    E = spec.router.num_experts
    # a lower bound first, so that absurd sizes fail before anything is drawn
    _check_rows(spec, sum(spec.prefill_chunks) + spec.decode_steps)
    rows, real = _step_sizes(spec, torch.Generator().manual_seed(_token_seed(spec)))
    _check_rows(spec, sum(rows))
    work = spec.num_layers * sum(_layer_work(spec, sum(rows)))
    if work > MAX_WORK:
        raise _bad(f"this spec needs about {work:.3g} logit evaluations ({spec.num_layers:,} layers x {E:,} experts x "
                   "(2 x rows + calibration and bias-fit tokens)); the limit is 2**34 (a few minutes on two cores)",
                   fix="lower --layers, --experts, --fit-steps or the number of rows, or use --skew uniform/zipf/hot")
    _check_special_rows(spec, sum(real))
    return rows, real


def with_default_ties(spec: SynthSpec) -> SynthSpec:
    """``spec`` with ``ties`` lowered to what a layer can hold (its unpadded rows; none when
    topk == experts): what ``routetool synth`` does with its default ``--ties``, so that a
    trace of fewer rows needs no option. A ``ties`` given on purpose is never lowered:
    :func:`plan_steps` refuses one above what a layer holds.

    Raises:
        RouteToolError: as :func:`plan_steps`.
    """
    _, real = plan_steps(replace(spec, ties=0, nonfinite=0))
    return replace(spec, ties=min(spec.ties, _tie_capacity(spec, sum(real))))


def synth_work(spec: SynthSpec) -> int:
    """Total work units :func:`generate` then :func:`synth_stats` report through ``progress``.

    Raises:
        RouteToolError: as :func:`plan_steps`.
    """
    rows, _ = plan_steps(spec)
    return spec.num_layers * sum(_layer_work(spec, sum(rows)))


def _route_counts(logits: torch.Tensor, bias: torch.Tensor, router: RouterConfig) -> torch.Tensor:
    """Tokens per expert of a batch of finite float32 logits (calibration, bias fit).

    The scores and keys are the reference's (``routetool_kernels.reference``) for finite logits,
    computed in fewer passes; the picks use ``torch.topk``, whose choice between two exactly
    equal keys is unspecified: such ties are measure-zero in these continuous draws, and
    which of two tied experts is counted does not matter here. ``logits`` may be overwritten.
    """
    from routetool_kernels import reference

    keys = reference.scores(logits, router, finite_inplace=True)
    if bool(bias.any()):
        keys = keys.add_(bias.float())
    keys = reference.selection_keys(keys, router)  # group-limited routing: -inf outside the kept groups
    ids = torch.topk(keys, router.topk, dim=-1, sorted=False).indices
    return torch.bincount(ids.flatten(), minlength=router.num_experts)


def _imbalance(counts: torch.Tensor) -> float:
    c = counts.double()
    return float(c.max() / c.mean()) if c.sum() > 0 else 0.0


def _draw(n: int, num_experts: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.randn((n, _HIDDEN), generator=gen)
    noise = torch.randn((n, num_experts), generator=gen)
    return h, noise


def _combine(offset: torch.Tensor, dirs: torch.Tensor, h: torch.Tensor, noise: torch.Tensor,
             affinity: float) -> torch.Tensor:
    return offset + affinity * (h @ dirs) + 0.5 * noise


def _logits(offset: torch.Tensor, dirs: torch.Tensor, n: int, gen: torch.Generator,
            affinity: float = DEFAULT_AFFINITY) -> torch.Tensor:
    h, noise = _draw(n, offset.numel(), gen)
    return _combine(offset, dirs, h, noise, affinity)


def _layer_target(args: list[float], layer: int, num_layers: int) -> float:
    frac = layer / (num_layers - 1) if num_layers > 1 else 0.5  # a single layer gets X itself
    spread = args[1] if len(args) > 1 else 0.4
    return max(1.0, args[0] * ((1 - spread) + 2 * spread * frac))


def _offsets(kind: str, args: list[float], layer: int, spec: SynthSpec, dirs: torch.Tensor,
             gen: torch.Generator, progress: Callable[[int], None]) -> tuple[torch.Tensor, LayerCalibration]:
    E = spec.router.num_experts
    fixed = spec.affinity
    affinity = DEFAULT_AFFINITY if fixed is None else float(fixed)
    if kind == "uniform":
        return torch.zeros(E), LayerCalibration(layer, affinity)
    if kind == "zipf":
        ranks = torch.randperm(E, generator=gen).double() + 1
        return (-args[0] * ranks.log()).float(), LayerCalibration(layer, affinity)
    if kind == "hot":
        n_hot = min(E, int(args[0]))
        off = torch.zeros(E)
        off[torch.randperm(E, generator=gen)[:n_hot]] = math.log(args[1])
        return off, LayerCalibration(layer, affinity)
    # imbalance:X[:S] -- Gaussian offsets, scale found by bisection on a calibration batch
    unit = CALIBRATION_TOKENS * E
    budget = unit * (_OFFSET_ITERS + _AFFINITY_ITERS + 2)
    done = 0
    target = _layer_target(args, layer, spec.num_layers)
    shape = torch.randn(E, generator=gen)
    h, noise = _draw(CALIBRATION_TOKENS, E, gen)
    base = h @ dirs
    calib = torch.zeros(E) + affinity * base + 0.5 * noise  # as _logits with zero offsets
    zero_bias = torch.zeros(E)

    def imbalance(logits: torch.Tensor) -> float:
        nonlocal done
        value = _imbalance(_route_counts(logits, zero_bias, spec.router))
        done += unit
        progress(unit)
        return value

    def bisect(lo: float, hi: float, iters: int, logits: Callable[[float], torch.Tensor]) -> tuple[float, float]:
        for _ in range(iters):
            mid = (lo + hi) / 2
            if imbalance(logits(mid)) < target:
                lo = mid
            else:
                hi = mid
        return lo, hi

    lo, hi = bisect(0.0, _OFFSET_SCALE_MAX, _OFFSET_ITERS, lambda s: calib + s * shape)
    if hi == _OFFSET_SCALE_MAX:  # even the largest offsets stay below the target: look further
        lo, hi = bisect(_OFFSET_SCALE_MAX, _OFFSET_SCALE_EXTENDED, _AFFINITY_ITERS, lambda s: calib + s * shape)
    if lo == 0.0 and fixed is None and imbalance(calib.clone()) > target:
        # the target is below the unskewed level of this affinity: no offsets, a lower affinity
        def no_offsets(a: float) -> torch.Tensor:
            return torch.zeros(E) + a * base + 0.5 * noise

        if imbalance(no_offsets(0.0)) >= target:  # even sampling noise alone is above the target
            lo_a = hi_a = 0.0
        else:
            lo_a, hi_a = bisect(0.0, affinity, _AFFINITY_ITERS - 2, no_offsets)
        affinity, scale = (lo_a + hi_a) / 2, 0.0
        offset = torch.zeros(E)
        calibrated = imbalance(no_offsets(affinity))
    else:
        scale = (lo + hi) / 2
        offset = scale * shape
        calibrated = imbalance(calib + offset)
    progress(max(0, budget - done))
    reached = abs(calibrated - target) <= _REACHED_TOLERANCE * target
    return offset, LayerCalibration(layer, affinity, offset_scale=scale, target=target, calibrated=calibrated,
                                     reached=reached)


def _fit_bias(offset: torch.Tensor, dirs: torch.Tensor, spec: SynthSpec, gen: torch.Generator, affinity: float,
              progress: Callable[[int], None]) -> torch.Tensor:
    bias = torch.zeros(spec.router.num_experts)
    for _ in range(spec.fit_steps):
        counts = _route_counts(_logits(offset, dirs, _FIT_TOKENS, gen, affinity), bias, spec.router).double()
        bias += spec.bias_update_rate * torch.sign(counts.mean() - counts).float()
        progress(_FIT_TOKENS * spec.router.num_experts)
    return bias


def _inject_ties(logits: torch.Tensor, bias: torch.Tensor, rows: torch.Tensor, spec: SynthSpec) -> int:
    from routetool_kernels.reference import biased_scores, scores, select

    r = spec.router
    made = 0
    for row in rows.tolist():
        x = logits[row:row + 1]
        b = select(biased_scores(scores(x, r), bias), r)[1][0]
        order = torch.sort(b, descending=True, stable=True).indices
        kth = int(order[r.topk - 1])
        for cand in order[r.topk:].tolist():
            if bias[cand] == bias[kth]:
                logits[row, cand] = logits[row, kth]
                made += 1
                break
    return made
def _noop(_: int) -> None:
    pass


def generate(spec: SynthSpec, progress: Callable[[int], None] | None = None) -> SynthResult:
    """Make a synthetic trace: metadata, per-layer tensors (for :func:`write_trace`) and how
    each layer was calibrated.

    Args:
        spec: what to make. progress: called with work units done (their total, with the
            statistics, is :func:`synth_work`).

    Raises:
        RouteToolError: an impossible spec or one above :data:`LIMITS` (checked before any work).
    """
    progress = progress or _noop
    rows, real = plan_steps(spec)
    kind, args = _parse_skew(spec.skew, spec.router)
    gen = torch.Generator().manual_seed(spec.seed)  # the model: directions, offsets, bias
    tokens = gen if spec.token_seed is None else torch.Generator().manual_seed(spec.token_seed)  # the traffic
    _step_sizes(spec, tokens)  # the same draws as plan_steps made, so the generator is where it was
    E = spec.router.num_experts
    gen_work = _layer_work(spec, sum(rows))[0]
    offsets = torch.tensor([0] + rows).cumsum(0)
    padding = torch.zeros(int(offsets[-1]), dtype=torch.bool)
    for start, n_rows, n_real in zip(offsets.tolist(), rows, real):
        padding[start + n_real:start + n_rows] = True
    unpadded = torch.nonzero(~padding).flatten()
    layers: dict[int, LayerArrays] = {}
    calibration: list[LayerCalibration] = []
    for layer in range(spec.num_layers):
        dirs = torch.randn((_HIDDEN, E), generator=gen) / math.sqrt(_HIDDEN)
        offset, cal = _offsets(kind, args, layer, spec, dirs, gen, progress)
        calibration.append(cal)
        if spec.bias == "fitted":
            bias = _fit_bias(offset, dirs, spec, gen, cal.affinity, progress)
        else:
            bias = torch.zeros(E)
        logits = _logits(offset, dirs, int(offsets[-1]), tokens, cal.affinity).to(spec.dtype)
        special = unpadded[torch.randperm(unpadded.numel(), generator=tokens)]
        n_ties = spec.ties  # at most what the layer holds (plan_steps)
        tie_rows = special[:n_ties]
        if n_ties:
            _inject_ties(logits, bias, tie_rows, spec)
        bad_rows = special[n_ties:n_ties + spec.nonfinite]
        for row in bad_rows.tolist():
            cols = torch.randperm(E, generator=tokens)[:2]
            logits[row, cols[0]] = float("nan")
            if E > 1:
                logits[row, cols[1]] = float("inf")
        layers[layer] = LayerArrays(
            gating_output=logits,
            bias=bias,
            is_padding=padding.clone(),
            step_offsets=offsets.clone(),
        )
        progress(gen_work)
    r = spec.router
    provenance = (
        f"routetool synth seed={spec.seed}" + (f" token_seed={spec.token_seed}" if spec.token_seed is not None else "")
        + f" skew={spec.skew} bias={spec.bias}"
        + (f" (u={spec.bias_update_rate:g}, {spec.fit_steps} updates)" if spec.bias == "fitted" else "")
        + _affinity_note(spec, calibration)
        + f" dtype={str(spec.dtype).removeprefix('torch.')} prefill={list(spec.prefill_chunks)}"
        f" decode_steps={spec.decode_steps} max_decode_batch={spec.max_decode_batch}"
        + (f" padding={spec.padding}" if spec.padding != "graph" else "")
        + (f" order={spec.order}" if spec.order != "prefill-first" else "")
        + f" ties={spec.ties} nonfinite={spec.nonfinite}; logits are synthetic, not from a model"
    )
    meta = TraceMeta(model=spec.model, router=r, provenance=provenance, extra={"generator": "routetool.synth"})
    return SynthResult(meta=meta, layers=layers, calibration=calibration)


def _affinity_note(spec: SynthSpec, calibration: list[LayerCalibration]) -> str:
    """The provenance's word on the affinity: nothing for 1.5 everywhere (as traces made
    before the affinity could change), else what it was."""
    if spec.affinity is not None and float(spec.affinity) != DEFAULT_AFFINITY:
        return f" affinity={float(spec.affinity):g}"
    lowered = [c for c in calibration if c.affinity != DEFAULT_AFFINITY]
    if not lowered:
        return ""
    where = ", ".join(f"{c.affinity:.4g} on layer {c.layer}" for c in lowered)
    return f" affinity=auto (1.5, lowered to {where} to meet imbalance targets below the unskewed level)"


def synthesize(spec: SynthSpec,
               progress: Callable[[int], None] | None = None) -> tuple[TraceMeta, dict[int, LayerArrays]]:
    """Make a synthetic trace: metadata and per-layer tensors for :func:`write_trace`
    (:func:`generate` without the calibration report).

    Raises:
        RouteToolError: an impossible spec or one above :data:`LIMITS` (checked before any work).
    """
    result = generate(spec, progress)
    return result.meta, result.layers


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
        imbalance_target: the layer's ``imbalance:X`` target (None for other skews or
            without a calibration report). calibrated_imbalance: what the calibration batch
            reached. target_reached: within 10 % on the calibration batch.
        affinity: the token-expert affinity used (None without a calibration report).
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
    imbalance_target: float | None = None
    calibrated_imbalance: float | None = None
    target_reached: bool = True
    affinity: float | None = None


def synth_stats(meta: TraceMeta, layers: dict[int, LayerArrays],
                calibration: list[LayerCalibration] | None = None,
                progress: Callable[[int], None] | None = None) -> list[SynthLayerStats]:
    """Realised statistics of a synthetic trace (routing by the reference, padded rows
    excluded), computed in blocks of rows so that memory stays near one block.

    Args:
        meta, layers: what :func:`synthesize` returned. calibration: its per-layer
            calibration (:func:`generate`), to report targets and affinities.
        progress: called with work units done (rows x experts per layer).
    """
    from routetool_kernels import reference
    from routetool_kernels.reference import biased_scores, select
    from routetool.engine.compare import boundary_margins
    from routetool.engine.load import load_stats

    progress = progress or _noop
    r = meta.router
    E = r.num_experts
    by_layer = {c.layer: c for c in calibration or []}
    block = max(1, STATS_BLOCK_ELEMENTS // max(E, 1))
    out = []
    for layer, arrays in sorted(layers.items()):
        logits = arrays.gating_output
        n = int(logits.shape[0])
        pad = arrays.is_padding if arrays.is_padding is not None else torch.zeros(n, dtype=torch.bool)
        bias = arrays.bias.float() if arrays.bias is not None else torch.zeros(E)
        counts = torch.zeros(E, dtype=torch.int64)
        counts0 = torch.zeros(E, dtype=torch.int64)
        ties = nonfinite = 0
        for start in range(0, n, block):
            stop = min(n, start + block)
            x, p = logits[start:stop], pad[start:stop]
            scores = reference.scores(x, r)
            ids, biased = select(biased_scores(scores, bias), r)
            real = ~p
            counts += torch.bincount(ids[real].flatten(), minlength=E)
            unbiased = biased_scores(scores[real], torch.zeros_like(bias))
            counts0 += torch.bincount(select(unbiased, r)[0].flatten(), minlength=E)
            ties += int((boundary_margins(biased, r.topk, p) == 0).sum())
            nonfinite += int((~torch.isfinite(x.float())).any(-1).sum())
            progress((stop - start) * E)
        stats, stats0 = load_stats(counts), load_stats(counts0)
        offsets = arrays.step_offsets
        cal = by_layer.get(layer)
        out.append(SynthLayerStats(
            layer=layer,
            num_tokens=n,
            num_steps=int(offsets.numel() - 1) if offsets is not None else 1,
            padded_rows=int(pad.sum()),
            nonfinite_rows=nonfinite,
            boundary_ties=ties,
            imbalance_zero_bias=stats0.imbalance,
            imbalance=stats.imbalance,
            cv=stats.cv,
            idle_experts=len(stats.idle),
            bias_abs_max=float(bias.abs().max()) if bias.numel() else 0.0,
            imbalance_target=cal.target if cal else None,
            calibrated_imbalance=cal.calibrated if cal else None,
            target_reached=cal.reached if cal else True,
            affinity=cal.affinity if cal else None,
        ))
    return out


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.3g}" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g}-{hi:.3g}"


def synth_warnings(stats: list[SynthLayerStats]) -> list[str]:
    """Lines saying which layers' ``imbalance:X`` targets the model could not meet, one per
    reason: below sampling noise alone, below the level of a fixed affinity, above what the
    largest offsets give."""
    groups: dict[tuple[str, str], list[SynthLayerStats]] = {}
    for st in stats:
        if st.imbalance_target is None or st.calibrated_imbalance is None or st.target_reached:
            continue
        if st.calibrated_imbalance <= st.imbalance_target:
            key = ("above the highest level the model can make", "at the largest offsets")
        elif not st.affinity:
            key = ("below the lowest level the model can make", "from sampling noise alone, with no offsets and no "
                   "token-expert affinity; fewer experts or a larger topk lower it")
        else:
            key = (f"below the level of the fixed affinity {st.affinity:g}",
                   "with no offsets; --affinity auto lowers the affinity to meet it")
        groups.setdefault(key, []).append(st)
    lines = []
    for (what, how), group in groups.items():
        layers = ", ".join(str(st.layer) for st in group)
        targets = _span([st.imbalance_target for st in group])
        got = _span([st.calibrated_imbalance for st in group])
        lines.append(f"layer{'s' if len(group) > 1 else ''} {layers}: imbalance target {targets} is {what}; got "
                     f"{got} max/mean on {CALIBRATION_TOKENS:,} calibration tokens ({how})")
    return lines
