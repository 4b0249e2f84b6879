"""The built-in edge-case suite of ``routetool validate``: families of generated cases.

Every case is built from a fixed seed (derived from its name), so a suite is the same on
every machine. What the correct output of each family is, is written in docs/validate.md.
Families: ties, nonfinite, bias, shapes, models, layouts, dtypes, padding, parameters.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from routetool_kernels.spec import RouterSpec

SUITES = ("quick", "full")

SHAPE_EXPERTS = (1, 2, 3, 8, 24, 60, 64, 72, 128, 160, 256, 384, 512)
SHAPE_TOPK = (1, 2, 4, 6, 8, 10, 16, 22)


@dataclass
class CaseInput:
    """Arguments of one routing call (the seed's signature).

    Attributes:
        gating_output: ``[T, E]`` logits. bias: ``[E]``.
        router: the router's parameters (``router.num_experts`` is ``E``).
        is_padding: ``[T]`` bool or None. topk_weights / topk_ids: caller buffers or None.
    """

    gating_output: torch.Tensor
    bias: torch.Tensor
    router: RouterSpec
    is_padding: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None

    @classmethod
    def of(cls, gating_output: torch.Tensor, bias: torch.Tensor, topk: int, *, is_padding: torch.Tensor | None = None,
           topk_weights: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None, **router) -> CaseInput:
        """A case's inputs: the router of ``gating_output``'s columns, ``topk``, ``route_scale`` 2.5
        unless given, and the other :class:`~routetool_kernels.spec.RouterSpec` fields in ``router``."""
        spec = RouterSpec(num_experts=gating_output.shape[-1], topk=topk, **{**CASE_ROUTER, **router})
        return cls(gating_output, bias, spec, is_padding, topk_weights, topk_ids)

    @property
    def topk(self) -> int:
        return self.router.topk

    def with_rows(self, gating_output: torch.Tensor, is_padding: torch.Tensor | None) -> CaseInput:
        """The same router and bias on other rows, without caller buffers."""
        return CaseInput(gating_output, self.bias, self.router, is_padding)

    def kwargs(self) -> dict:
        """Keyword arguments for the kernel (and, without buffers, the reference)."""
        return {**self.router.kernel_kwargs(), "is_padding": self.is_padding}

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference's ``(topk_weights, topk_ids, scores, biased)`` for these inputs
        (:func:`routetool_kernels.reference.route`)."""
        from routetool_kernels import reference

        return reference.route(self.gating_output, self.bias, self.router, is_padding=self.is_padding)


CASE_ROUTER = {"route_scale": 2.5}
"""What a case's router sets beyond its shape, unless the case says otherwise."""


@dataclass
class Case:
    """One generated edge case.

    Attributes:
        family / name: grouping and identity (``name`` is unique and seeds the generator).
        description: what the case exercises.
        build: makes the inputs on a device.
        feature: the unusual property of the input (e.g. ``"bfloat16"``), used to decide
            whether a kernel's rejection of it is documented.
        checks: extra checks beyond the per-output invariants: ``"determinism"`` (the same
            input routed again gives bit-identical outputs), ``"row_order"`` (outputs do not
            depend on the order of unrelated rows), ``"batch"`` (each token's outputs are
            bit-identical when it is routed in a batch of each of ``batch_sizes``, at another
            position, with padded rows around it: :func:`batch_around`),
            ``"batch_determinism"`` (the largest of those batches routed again gives
            bit-identical outputs), ``"mask_change"`` (changing the padding mask and
            bias in place between two calls changes the output), ``"cuda_graph"`` (the same
            through one captured CUDA graph).
        cuda_only: needs a GPU (size or CUDA graphs); skipped elsewhere.
        tags: facts about the case for selecting it: ``beyond_seed``, the semantics its router asks
            beyond the seed's (:meth:`~routetool_kernels.spec.RouterSpec.beyond_seed`), which a kernel of
            the seed's semantics rejects.
        batch_sizes: for ``"batch"``: the sizes of the other batches each token is routed in.
    """

    family: str
    name: str
    description: str
    build: Callable[[torch.device], CaseInput]
    feature: str | None = None
    checks: tuple[str, ...] = ()
    cuda_only: bool = False
    tags: dict = field(default_factory=dict)
    batch_sizes: tuple[int, ...] = ()


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def _randn(name: str, shape, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(name)) * scale


def _bias(name: str, E: int, scale: float = 0.05) -> torch.Tensor:
    return torch.randn(E, generator=_gen(name + "/bias")) * scale


def _simple(name: str, T: int, E: int, K: int, dtype=torch.float32, **kw) -> Callable[[torch.device], CaseInput]:
    def build(device: torch.device) -> CaseInput:
        return CaseInput.of(gating_output=_randn(name, (T, E)).to(dtype).to(device), bias=_bias(name, E).to(device),
                         topk=K, **kw)
    return build


# --------------------------------------------------------------------------------------- ties
def _ties(suite: str) -> list[Case]:
    cases = []
    for E, K in ((8, 2), (60, 4), (256, 8), (384, 8)):
        name = f"ties/equal-rows/E{E}-k{K}"

        def build(device, E=E, K=K, name=name):
            g = torch.zeros((5, E))
            g[1] = 1.5
            g[2] = -3.0
            g[3] = _randn(name, (E,))
            g[3, : E // 2] = g[3, 0]
            return CaseInput.of(gating_output=g.to(device), bias=torch.zeros(E, device=device), topk=K)
        cases.append(Case("ties", name, f"rows of equal logits, E={E}: picks must be the lowest indices", build))

        name = f"ties/integer-logits/E{E}-k{K}"

        def build_int(device, E=E, K=K, name=name):
            g = torch.randint(-3, 4, (33, E), generator=_gen(name)).float()
            return CaseInput.of(gating_output=g.to(device), bias=torch.zeros(E, device=device), topk=K)
        cases.append(Case("ties", name, "integer-valued logits: many exact ties at every rank", build_int,
                          checks=("determinism", "row_order")))

        name = f"ties/bf16-boundary/E{E}-k{K}"

        def build_bf16(device, E=E, K=K, name=name):
            g = _randn(name, (33, E)).to(torch.bfloat16)
            b = torch.zeros(E)
            for r in range(g.shape[0]):  # copy the k-th logit onto the next experts: exact ties at the boundary
                order = torch.sort(g[r].float(), descending=True, stable=True).indices
                if K < E:
                    g[r, order[K:K + 3]] = g[r, order[K - 1]].clone()
            return CaseInput.of(gating_output=g.to(device), bias=b.to(device), topk=K)
        cases.append(Case("ties", name, "bf16 logits colliding exactly at the k-th boundary", build_bf16,
                          feature="bfloat16"))
    # Prefill-sized batches, so that a GPU runs the kernel's large-batch algorithm on ties too
    # (the tiled kernel's two-level merge sends tied rows to its redo). GPU-only: under the
    # interpreter the tiled kernel runs the 33-row cases' scan, 33 tiles over (a second of the
    # quick suite's time on a CPU).
    for E, K in ((64, 8),) if suite == "quick" else ((64, 8), (256, 8)):
        name = f"ties/prefill/E{E}-k{K}"

        def build_prefill(device, E=E, K=K, name=name):
            T = 4100
            g = _randn(name, (T, E), scale=0.3)
            g[0::4] = 0.0                                  # every logit equal
            g[1::4, : E // 2] = 1.0                        # the first half equal, above the rest
            g[2::4] = torch.randint(-3, 4, (len(range(2, T, 4)), E), generator=_gen(name + "/int")).float()
            return CaseInput.of(gating_output=g.to(device), bias=torch.zeros(E, device=device), topk=K)
        cases.append(Case("ties", name, "4100 rows (a prefill batch) of equal, half-equal and integer logits",
                          build_prefill, cuda_only=True))
    return cases


# ---------------------------------------------------------------------------------- non-finite
def _nonfinite(suite: str) -> list[Case]:
    cases = []
    for norm in ("sigmoid", "softmax"):
        for what in ("all-nan", "some-nan", "all-neg-inf", "pos-inf", "underflow"):
            for eps in (None, 1e-6):
                if what != "underflow" and eps is not None:
                    continue
                name = f"nonfinite/{what}/{norm}" + (f"/eps{eps:g}" if eps is not None else "")

                def build(device, what=what, norm=norm, eps=eps, name=name):
                    E, K = 64, 6
                    g = _randn(name, (9, E))
                    rows = [1, 4, 7]
                    if what == "all-nan":
                        g[rows] = float("nan")
                    elif what == "some-nan":
                        g[rows, :5] = float("nan")
                        g[rows, 40] = float("nan")
                    elif what == "all-neg-inf":
                        g[rows] = float("-inf")
                    elif what == "pos-inf":
                        g[rows, 3] = float("inf")
                        g[rows, 17] = float("inf")
                    else:
                        g[rows] = -1e4 + _randn(name + "/u", (3, E))
                    return CaseInput.of(gating_output=g.to(device), bias=_bias(name, E).to(device), topk=K,
                                     router_score_normalization=norm, router_score_division_eps=eps)
                cases.append(Case("nonfinite", name, f"{what} rows under {norm}", build))
    return cases


# ---------------------------------------------------------------------------------------- bias
def _bias_family(suite: str) -> list[Case]:
    cases = []
    specs = {
        "negative-below-0": lambda n, E: -torch.rand(E, generator=_gen(n)) * 0.9,
        "negative-below-minus-1": lambda n, E: -1.0 - torch.rand(E, generator=_gen(n)) * 2,
        "dominating": lambda n, E: torch.where(torch.arange(E) % 7 == 3, 50.0, 0.0),
        "mixed-large": lambda n, E: torch.randn(E, generator=_gen(n)) * 3,
    }
    for label, make in specs.items():
        for bias_dtype in (torch.float32, torch.bfloat16):
            name = f"bias/{label}/{str(bias_dtype).removeprefix('torch.')}"

            def build(device, make=make, bias_dtype=bias_dtype, name=name):
                E, K = 96, 8
                return CaseInput.of(gating_output=_randn(name, (33, E)).to(device),
                                 bias=make(name, E).to(bias_dtype).to(device), topk=K)
            cases.append(Case("bias", name, f"{label} bias in {bias_dtype}", build,
                              feature="bias " + str(bias_dtype).removeprefix("torch.")
                              if bias_dtype != torch.float32 else None))
    return cases


# -------------------------------------------------------------------------------------- shapes
def _shapes(suite: str) -> list[Case]:
    cases = []
    if suite == "quick":
        experts, topks, tokens = (1, 3, 8, 60, 256, 384), (1, 8), (1, 33)
    else:
        experts, topks, tokens = SHAPE_EXPERTS, SHAPE_TOPK, (1, 33, 4096)
    for E in experts:
        ks = {k for k in topks if k <= E}
        if suite == "full" or E <= 8:
            ks.add(E)  # topk == num_experts
        for K in sorted(ks):
            for T in tokens:
                name = f"shapes/T{T}-E{E}-k{K}"
                cases.append(Case("shapes", name, f"{T} tokens, {E} experts, topk {K}", _simple(name, T, E, K),
                                  checks=("determinism", "row_order") if T == 33 and E in (60, 256) else ()))
    if suite == "quick":  # a prefill-sized batch that the CPU routes in about a second: a kernel's
        # path for large batches (engines switch at 256 tokens and above) runs in the quick suite too
        T, E, K = 2049, 8, 2
        name = f"shapes/T{T}-E{E}-k{K}"
        cases.append(Case("shapes", name, f"{T} tokens (a prefill batch), {E} experts, topk {K}",
                          _simple(name, T, E, K)))
    if suite == "full":
        for T, E, K in ((65536, 256, 8), (32768, 384, 8), (16384, 512, 22)):
            name = f"shapes/prefill-T{T}-E{E}-k{K}"
            cases.append(Case("shapes", name, f"large prefill: {T} tokens, {E} experts", _simple(name, T, E, K),
                              cuda_only=True))
    return cases


# -------------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ModelShape:
    """The router of a served MoE model: ``(num_experts, topk)``, scoring function, whether the
    selection has a bias (``e_score_correction_bias``; otherwise zeros), ``route_scale``
    (routed_scaling_factor) and the semantics beyond the seed's (group-limited selection,
    ``norm_topk_prob``, eps), as their published configs have them (docs/semantics.md).

    The cases written before the reference routed those semantics stand for their model's shape and
    scores, as a MuseSpark1x kernel routes them (DeepSeek-V3 without its groups, Qwen2-MoE
    renormalised); the cases with ``semantics`` set carry the model's own routing, which the
    MuseSpark1x kernels reject as documented and a kernel written to it must pass.
    ``bias_dtype``: the bias's dtype as the engine holds it (a bf16 bias rounds, and its rounding
    changes picks: :func:`_rounding_bias`)."""

    slug: str
    models: str
    num_experts: int
    topk: int
    normalization: str
    bias: bool
    route_scale: float = 1.0
    dtype: torch.dtype = torch.float32
    semantics: dict = field(default_factory=dict)
    bias_dtype: torch.dtype = torch.float32

    def router(self) -> dict:
        """The :class:`~routetool_kernels.spec.RouterSpec` fields of this model beyond its shape."""
        return {"route_scale": self.route_scale, "router_score_normalization": self.normalization, **self.semantics}


MODEL_SHAPES = (
    ModelShape("mixtral", "Mixtral 8x7B / 8x22B", 8, 2, "softmax", False),
    ModelShape("qwen1.5-moe", "Qwen1.5-MoE-A2.7B", 60, 4, "softmax", False),
    ModelShape("deepseek-v2-lite", "DeepSeek-V2-Lite", 64, 6, "softmax", False),
    ModelShape("qwen2-moe-olmoe", "Qwen2-57B-A14B (Qwen2-MoE), OLMoE-1B-7B", 64, 8, "softmax", False),
    ModelShape("gpt-oss", "gpt-oss-120b (gpt-oss-20b: 32 experts, topk 4)", 128, 4, "softmax", False),
    ModelShape("qwen3-moe", "Qwen3-30B-A3B, Qwen3-235B-A22B (Qwen3-MoE)", 128, 8, "softmax", False),
    ModelShape("glm-4.5-air", "GLM-4.5-Air", 128, 8, "sigmoid", True),
    ModelShape("deepseek-v2", "DeepSeek-V2", 160, 6, "softmax", False, 16.0),
    ModelShape("glm-4.5", "GLM-4.5", 160, 8, "sigmoid", True, 2.5),
    ModelShape("deepseek-v3-r1", "DeepSeek-V3, DeepSeek-R1", 256, 8, "sigmoid", True, 2.5),
    ModelShape("musespark1x", "MuseSpark1x (bf16 logits, as it serves them)", 256, 8, "sigmoid", True, 2.5,
               torch.bfloat16),
    ModelShape("kimi-k2", "Kimi-K2", 384, 8, "sigmoid", True, 2.827),
    ModelShape("qwen3-next", "Qwen3-Next-80B-A3B, Qwen3.5", 512, 10, "softmax", False),
    ModelShape("topk16", "topk 16 (beyond 8-slot arrays)", 256, 16, "sigmoid", True, 2.5),
    ModelShape("topk22", "topk 22 (beyond 8- and 16-slot arrays)", 512, 22, "softmax", False),
    # the 2026 family, each with its own routing semantics
    ModelShape("kimi-k3", "Kimi-K3 (its shape, with Kimi-K2's router)", 896, 16, "sigmoid", True, 2.827),
    ModelShape("glm-5", "GLM-5", 256, 8, "sigmoid", True, 2.5),
    ModelShape("minimax-m2", "MiniMax-M2 / M2.5", 256, 8, "sigmoid", True),
    ModelShape("deepseek-v3-grouped", "DeepSeek-V3/R1 as configured (8 groups, the best 4)", 256, 8, "sigmoid", True,
               2.5, semantics={"n_group": 8, "topk_group": 4, "router_score_division_eps": 1e-20}),
    ModelShape("deepseek-v2-grouped", "DeepSeek-V2 as configured (8 groups by their best score, the best 3)", 160, 6,
               "softmax", False, 16.0, semantics={"n_group": 8, "topk_group": 3, "topk_method": "group_limited_greedy",
                                                  "norm_topk_prob": False}),
    ModelShape("deepseek-v3-bf16-bias", "DeepSeek-V3 with its bias in bf16 (a checkpoint loaded in bf16)", 256, 8,
               "sigmoid", True, 2.5, bias_dtype=torch.bfloat16),
    ModelShape("deepseek-v4", "DeepSeek-V4", 384, 6, "sqrtsoftplus", True, 1.5),
    ModelShape("deepseek-v4-flash", "DeepSeek-V4-Flash", 256, 6, "sqrtsoftplus", True, 1.5),
    ModelShape("qwen2-moe-olmoe-raw", "Qwen2-MoE, OLMoE as configured (norm_topk_prob false)", 64, 8, "softmax",
               False, semantics={"norm_topk_prob": False}),
    ModelShape("gpt-oss-120b", "gpt-oss-120b (top-k of the logits, softmax over the picks)", 128, 4,
               "topk_then_softmax", False),
    ModelShape("gpt-oss-20b", "gpt-oss-20b (top-k of the logits, softmax over the picks)", 32, 4,
               "topk_then_softmax", False),
)
"""The production shapes of the ``models`` family, in both suites (docs/validate.md)."""

MODEL_TOKENS = 7
"""Tokens of a ``models`` case: a 7-row batch (an 8-row tile with one row masked under the
interpreter), rows :data:`MODEL_PADDED_ROWS` padded."""
MODEL_PADDED_ROWS = (2, 5)

BATCH_SIZES = (1, 129)
"""Other batches a ``models`` case's tokens are routed in (with the case's own 7 rows).
The ``tiled`` kernel under the Triton interpreter routes ``min(128, next_pow2(T))`` rows per
program (``routetool_kernels.routing_policy.default_config``): a token alone (a 1-row tile, no padding mask),
7 rows (one 8-row tile) and 129 rows (two 128-row tiles, the second holding one row)."""

def _gpu_batch_sizes() -> tuple[int, ...]:
    from routetool_kernels import routing_policy as policy

    per_sm = max(policy.two_level_config(policy.PERSISTENT_FROM + 1, e).programs_per_sm for e in (256, 384))
    sizes = (policy.SMALL_BATCH, policy.SMALL_BATCH + 1, policy.PERSISTENT_FROM + 1, per_sm * 256 + 1,
             policy.DYNAMIC_TILES_FROM * per_sm * 148)
    return sizes + tuple(n + 1 for n in sorted(policy.rows_switches()) if n + 1 not in sizes)


GPU_BATCH_SIZES = _gpu_batch_sizes()
"""The GPU batches of a ``models`` case (``cuda_only``), read from the ``tiled`` kernel's switches on a
GPU (``routetool_kernels.routing_policy``), so that a token is compared across each of them: up to
``SMALL_BATCH`` (2048) tokens the scan algorithm, above it (2049) the rows algorithm for sigmoid routers
of ``topk`` <= 8 and <= 256 experts, else the two-level one; above ``PERSISTENT_FROM`` (4097) the
two-level launch asks for ``programs_per_sm`` (32) programs per SM, a
persistent grid once the tokens exceed that times the SM count (8193: up to 256 SMs); tiles
claimed from atomic counters from ``DYNAMIC_TILES_FROM`` (8) times that grid (37888: up to
148 SMs, an H200 has 132); and the rows algorithm's other switch (32769: float32 logits two threads a token
above 32768 for up to 128 experts, four for more; the others switch at 8192)."""


def _rounding_bias(name: str, E: int) -> torch.Tensor:
    """A bias around 1.5 in bf16 (step 2^-7): its rounding from the float32 values it was drawn as
    moves keys by up to 0.004, more than the gaps between the best sigmoid scores of 256 experts,
    so the bf16 bias picks other experts than the float32 one would (what a bf16-loaded
    ``e_score_correction_bias`` does to DeepSeek-V3's routing), and keys rounded to bf16 tie."""
    return (1.5 + torch.randn(E, generator=_gen(name + "/bias")) * 0.05).to(torch.bfloat16)


def _model_build(name: str, shape: ModelShape) -> Callable[[torch.device], CaseInput]:
    def build(device: torch.device) -> CaseInput:
        E = shape.num_experts
        pad = torch.zeros(MODEL_TOKENS, dtype=torch.bool)
        pad[list(MODEL_PADDED_ROWS)] = True
        if shape.bias_dtype != torch.float32:
            bias = _rounding_bias(name, E).to(shape.bias_dtype)
        else:
            bias = _bias(name, E, scale=0.1) if shape.bias else torch.zeros(E)
        return CaseInput.of(gating_output=_randn(name, (MODEL_TOKENS, E)).to(shape.dtype).to(device),
                         bias=bias.to(device), topk=shape.topk, is_padding=pad.to(device), **shape.router())
    return build


def _models(suite: str) -> list[Case]:
    cases = []
    for shape in MODEL_SHAPES:
        E, K = shape.num_experts, shape.topk
        name = f"models/{shape.slug}/E{E}-k{K}"
        dtype = str(shape.dtype).removeprefix("torch.")
        bias_dtype = str(shape.bias_dtype).removeprefix("torch.")
        semantics = "".join(f", {k}={v}" for k, v in shape.semantics.items())
        what = (f"{shape.models}: {E} experts, topk {K}, {shape.normalization}"
                f"{' + bias' if shape.bias else ', no bias'}"
                f"{' (' + bias_dtype + ')' if shape.bias_dtype != torch.float32 else ''}, route_scale "
                f"{shape.route_scale:g}{semantics}{', ' + dtype if shape.dtype != torch.float32 else ''}")
        beyond = RouterSpec(num_experts=E, topk=K, **shape.router()).beyond_seed()
        feature = beyond[0] if beyond else dtype if shape.dtype != torch.float32 else \
            f"bias {bias_dtype}" if shape.bias_dtype != torch.float32 else None
        build = _model_build(name, shape)
        tags = {"beyond_seed": tuple(beyond)} if beyond else {}
        cases.append(Case("models", name, f"{what}; {MODEL_TOKENS} tokens, 2 padded; batches of "
                          f"{', '.join(map(str, BATCH_SIZES))}", build, feature=feature,
                          checks=("determinism", "batch"), batch_sizes=BATCH_SIZES, tags=dict(tags)))
        cases.append(Case("models", name + "/large-batches", f"{what}; its tokens in batches of "
                          f"{', '.join(map(str, GPU_BATCH_SIZES))}", build, feature=feature,
                          checks=("batch", "batch_determinism"), batch_sizes=GPU_BATCH_SIZES, cuda_only=True,
                          tags=dict(tags)))
    return cases


@dataclass
class BatchProbe:
    """Tokens of a case routed in another batch: the case's rows ``rows`` are rows
    ``positions`` of ``inp``, a batch of ``size`` rows."""

    size: int
    inp: CaseInput
    rows: list[int]
    positions: list[int]


def batch_around(name: str, inp: CaseInput, size: int) -> BatchProbe:
    """The batch of ``size`` rows that ``inp``'s tokens are routed in by the ``"batch"`` check.

    ``size`` >= the case's rows: every token, in reverse order, spread over
    the batch (the first token last), each unpadded token between two padded rows; the other
    rows are random logits (seeded by ``name`` and ``size``). Smaller: the first unpadded
    token, at the end of the batch, with no padding mask when ``size`` is 1. Same bias and
    parameters; no caller buffers.
    """
    T, E = inp.gating_output.shape
    device, dtype = inp.gating_output.device, inp.gating_output.dtype
    pad = inp.is_padding.cpu() if inp.is_padding is not None else torch.zeros(T, dtype=torch.bool)
    rows = list(range(T)) if size >= T else [next((r for r in range(T) if not pad[r]), 0)]
    stride = size // len(rows)
    positions = [size - 1 - j * stride for j in range(len(rows))]
    g = _randn(f"{name}/batch{size}", (size, E)).to(dtype).to(device)
    g[positions] = inp.gating_output[rows]
    mask = None
    if size > 1 or bool(pad[rows].any()):
        mask = torch.zeros(size, dtype=torch.bool)
        for r, p in zip(rows, positions):
            if not pad[r]:
                mask[[q for q in (p - 1, p + 1) if 0 <= q < size and q not in positions]] = True
        mask[positions] = pad[rows]
        mask = mask.to(device)
    batch = inp.with_rows(g, mask)
    return BatchProbe(size=size, inp=batch, rows=rows, positions=positions)


# ------------------------------------------------------------------------------------- layouts
def _layouts(suite: str) -> list[Case]:
    T, E, K = 33, 72, 6

    def column_slice(device, name="layouts/column-slice"):
        wide = _randn(name, (T, E + 9)).to(device)
        return CaseInput.of(gating_output=wide[:, 5:5 + E], bias=_bias(name, E).to(device), topk=K)

    def transposed(device, name="layouts/transposed"):
        return CaseInput.of(gating_output=_randn(name, (E, T)).to(device).t(), bias=_bias(name, E).to(device), topk=K)

    def big_buffers(device, name="layouts/larger-output-buffers"):
        return CaseInput.of(gating_output=_randn(name, (T, E)).to(device), bias=_bias(name, E).to(device), topk=K,
                         topk_weights=torch.empty((T + 7, K + 3), device=device),
                         topk_ids=torch.empty((T + 7, K + 3), dtype=torch.int32, device=device))

    def int64_ids(device, name="layouts/int64-ids-buffer"):
        return CaseInput.of(gating_output=_randn(name, (T, E)).to(device), bias=_bias(name, E).to(device), topk=K,
                         topk_weights=torch.empty((T, K), device=device),
                         topk_ids=torch.empty((T, K), dtype=torch.int64, device=device))

    def strided_bias(device, name="layouts/strided-bias"):
        return CaseInput.of(gating_output=_randn(name, (T, E)).to(device),
                         bias=_bias(name, 2 * E).to(device)[::2], topk=K)

    return [
        Case("layouts", "layouts/column-slice", "gating_output is a column slice of a wider tensor", column_slice,
             feature="non-contiguous"),
        Case("layouts", "layouts/transposed", "gating_output is a transposed view", transposed,
             feature="non-contiguous"),
        Case("layouts", "layouts/larger-output-buffers", "caller buffers larger than needed", big_buffers),
        Case("layouts", "layouts/int64-ids-buffer", "topk_ids buffer of int64", int64_ids, feature="int64"),
        Case("layouts", "layouts/strided-bias", "bias with stride 2", strided_bias, feature="contiguous"),
    ]


# -------------------------------------------------------------------------------------- dtypes
def _dtypes(suite: str) -> list[Case]:
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for E, K in ((256, 8), (60, 4)):
            dn = str(dtype).removeprefix("torch.")
            name = f"dtypes/{dn}/E{E}-k{K}"
            cases.append(Case("dtypes", name, f"gating_output in {dn}", _simple(name, 33, E, K, dtype),
                              feature=dn if dtype != torch.float32 else None))
    return cases


# ------------------------------------------------------------------------------------- padding
def _padding(suite: str) -> list[Case]:
    T, E, K = 33, 64, 6
    cases = []
    for label, mask in (("none", lambda: torch.zeros(T, dtype=torch.bool)),
                        ("all", lambda: torch.ones(T, dtype=torch.bool)),
                        ("some", lambda: torch.arange(T) % 3 == 1)):
        name = f"padding/{label}"

        def build(device, mask=mask, name=name):
            return CaseInput.of(gating_output=_randn(name, (T, E)).to(device), bias=_bias(name, E).to(device), topk=K,
                             is_padding=mask().to(device))
        cases.append(Case("padding", name, f"{label} rows padded", build))

    def changing(device, name="padding/mask-and-bias-change"):
        return CaseInput.of(gating_output=_randn(name, (T, E)).to(device), bias=_bias(name, E).to(device), topk=K,
                         is_padding=torch.zeros(T, dtype=torch.bool, device=device),
                         topk_weights=torch.empty((T, K), device=device),
                         topk_ids=torch.empty((T, K), dtype=torch.int32, device=device))
    cases.append(Case("padding", "padding/mask-and-bias-change",
                      "padding mask and bias changed in place between two calls on the same buffers", changing,
                      checks=("mask_change",)))
    cases.append(Case("padding", "padding/cuda-graph-replay",
                      "one CUDA graph captured, replayed after the padding mask and bias changed", changing,
                      checks=("cuda_graph",), cuda_only=True))
    return cases


# ---------------------------------------------------------------------------------- parameters
def _parameters(suite: str) -> list[Case]:
    cases = []
    for norm in ("sigmoid", "softmax"):
        for mult in (None, 0.35, 2.0, -1.5):  # negative: padding experts must stay -inf after it
            for eps in (None, 1e-3):
                for scale in (1.0, 2.5):
                    if suite == "quick" and (scale == 1.0 and mult is not None):
                        continue
                    name = f"parameters/{norm}/mult{mult}/eps{eps}/scale{scale}"
                    cases.append(Case("parameters", name, f"{norm}, multiplier {mult}, eps {eps}, route_scale {scale}",
                                      _simple(name, 33, 96, 6, router_score_normalization=norm,
                                              router_output_multiplier=mult, router_score_division_eps=eps,
                                              route_scale=scale)))
    return cases


FAMILIES = {
    "ties": _ties,
    "nonfinite": _nonfinite,
    "bias": _bias_family,
    "shapes": _shapes,
    "models": _models,
    "layouts": _layouts,
    "dtypes": _dtypes,
    "padding": _padding,
    "parameters": _parameters,
}


def build_suite(suite: str, families: list[str] | None = None) -> list[Case]:
    """The cases of ``suite`` (``quick`` or ``full``), optionally only some families, in the
    order given; a family named again is ignored (each case is built once).

    Raises:
        ValueError: an unknown suite or family name.
    """
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; expected quick or full")
    chosen = list(dict.fromkeys(families)) if families else list(FAMILIES)
    unknown = [f for f in chosen if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown family {', '.join(unknown)}; expected {', '.join(FAMILIES)}")
    return [case for fam in chosen for case in FAMILIES[fam](suite)]
