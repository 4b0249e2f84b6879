"""The built-in edge-case suite of ``routetool validate``: families of generated cases.

Every case is built from a fixed seed (derived from its name), so a suite is the same on
every machine. What the correct output of each family is, is written in docs/validate.md.
Families: ties, nonfinite, bias, shapes, layouts, dtypes, padding, parameters.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

SUITES = ("quick", "full")

SHAPE_EXPERTS = (1, 2, 3, 8, 24, 60, 64, 72, 128, 160, 256, 384, 512)
SHAPE_TOPK = (1, 2, 4, 6, 8, 10, 16, 22)


@dataclass
class CaseInput:
    """Arguments of one routing call (the seed's signature)."""

    gating_output: torch.Tensor
    bias: torch.Tensor
    topk: int
    route_scale: float = 2.5
    router_output_multiplier: float | None = None
    router_score_normalization: str = "sigmoid"
    router_score_division_eps: float | None = None
    is_padding: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None

    def kwargs(self) -> dict:
        """Keyword arguments for the kernel (and, without buffers, the reference)."""
        return dict(
            topk=self.topk, route_scale=self.route_scale, router_output_multiplier=self.router_output_multiplier,
            router_score_normalization=self.router_score_normalization,
            router_score_division_eps=self.router_score_division_eps, is_padding=self.is_padding,
        )


@dataclass
class Case:
    """One generated edge case.

    Attributes:
        family / name: grouping and identity (``name`` is unique and seeds the generator).
        description: what the case exercises.
        build: makes the inputs on a device.
        feature: the unusual property of the input (e.g. ``"bfloat16"``), used to decide
            whether a kernel's rejection of it is documented.
        checks: extra checks beyond the per-output invariants: ``"row_order"`` (outputs do
            not depend on the order of unrelated rows), ``"mask_change"`` (changing the
            padding mask and bias in place between two calls changes the output),
            ``"cuda_graph"`` (the same through one captured CUDA graph).
        cuda_only: needs a GPU (size or CUDA graphs); skipped elsewhere.
    """

    family: str
    name: str
    description: str
    build: Callable[[torch.device], CaseInput]
    feature: str | None = None
    checks: tuple[str, ...] = ()
    cuda_only: bool = False
    tags: dict = field(default_factory=dict)


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def _randn(name: str, shape, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(name)) * scale


def _bias(name: str, E: int, scale: float = 0.05) -> torch.Tensor:
    return torch.randn(E, generator=_gen(name + "/bias")) * scale


def _simple(name: str, T: int, E: int, K: int, dtype=torch.float32, **kw) -> Callable[[torch.device], CaseInput]:
    def build(device: torch.device) -> CaseInput:
        return CaseInput(gating_output=_randn(name, (T, E)).to(dtype).to(device), bias=_bias(name, E).to(device),
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
            return CaseInput(gating_output=g.to(device), bias=torch.zeros(E, device=device), topk=K)
        cases.append(Case("ties", name, f"rows of equal logits, E={E}: picks must be the lowest indices", build))

        name = f"ties/integer-logits/E{E}-k{K}"

        def build_int(device, E=E, K=K, name=name):
            g = torch.randint(-3, 4, (33, E), generator=_gen(name)).float()
            return CaseInput(gating_output=g.to(device), bias=torch.zeros(E, device=device), topk=K)
        cases.append(Case("ties", name, "integer-valued logits: many exact ties at every rank", build_int,
                          checks=("row_order",)))

        name = f"ties/bf16-boundary/E{E}-k{K}"

        def build_bf16(device, E=E, K=K, name=name):
            g = _randn(name, (33, E)).to(torch.bfloat16)
            b = torch.zeros(E)
            for r in range(g.shape[0]):  # copy the k-th logit onto the next experts: exact ties at the boundary
                order = torch.sort(g[r].float(), descending=True, stable=True).indices
                if K < E:
                    g[r, order[K:K + 3]] = g[r, order[K - 1]].clone()
            return CaseInput(gating_output=g.to(device), bias=b.to(device), topk=K)
        cases.append(Case("ties", name, "bf16 logits colliding exactly at the k-th boundary", build_bf16,
                          feature="bfloat16"))
    # Prefill-sized batches, so that a GPU runs the kernel's large-batch algorithm on ties too
    # (the tiled kernel's two-level merge sends tied rows to its redo).
    for E, K in ((64, 8),) if suite == "quick" else ((64, 8), (256, 8)):
        name = f"ties/prefill/E{E}-k{K}"

        def build_prefill(device, E=E, K=K, name=name):
            T = 4100
            g = _randn(name, (T, E), scale=0.3)
            g[0::4] = 0.0                                  # every logit equal
            g[1::4, : E // 2] = 1.0                        # the first half equal, above the rest
            g[2::4] = torch.randint(-3, 4, (len(range(2, T, 4)), E), generator=_gen(name + "/int")).float()
            return CaseInput(gating_output=g.to(device), bias=torch.zeros(E, device=device), topk=K)
        cases.append(Case("ties", name, "4100 rows (a prefill batch) of equal, half-equal and integer logits",
                          build_prefill))
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
                    return CaseInput(gating_output=g.to(device), bias=_bias(name, E).to(device), topk=K,
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
                return CaseInput(gating_output=_randn(name, (33, E)).to(device),
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
                                  checks=("row_order",) if T == 33 and E in (60, 256) else ()))
    if suite == "full":
        for T, E, K in ((65536, 256, 8), (32768, 384, 8), (16384, 512, 22)):
            name = f"shapes/prefill-T{T}-E{E}-k{K}"
            cases.append(Case("shapes", name, f"large prefill: {T} tokens, {E} experts", _simple(name, T, E, K),
                              cuda_only=True))
    return cases


# ------------------------------------------------------------------------------------- layouts
def _layouts(suite: str) -> list[Case]:
    T, E, K = 33, 72, 6

    def column_slice(device, name="layouts/column-slice"):
        wide = _randn(name, (T, E + 9)).to(device)
        return CaseInput(gating_output=wide[:, 5:5 + E], bias=_bias(name, E).to(device), topk=K)

    def transposed(device, name="layouts/transposed"):
        return CaseInput(gating_output=_randn(name, (E, T)).to(device).t(), bias=_bias(name, E).to(device), topk=K)

    def big_buffers(device, name="layouts/larger-output-buffers"):
        return CaseInput(gating_output=_randn(name, (T, E)).to(device), bias=_bias(name, E).to(device), topk=K,
                         topk_weights=torch.empty((T + 7, K + 3), device=device),
                         topk_ids=torch.empty((T + 7, K + 3), dtype=torch.int32, device=device))

    def int64_ids(device, name="layouts/int64-ids-buffer"):
        return CaseInput(gating_output=_randn(name, (T, E)).to(device), bias=_bias(name, E).to(device), topk=K,
                         topk_weights=torch.empty((T, K), device=device),
                         topk_ids=torch.empty((T, K), dtype=torch.int64, device=device))

    def strided_bias(device, name="layouts/strided-bias"):
        return CaseInput(gating_output=_randn(name, (T, E)).to(device),
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
            return CaseInput(gating_output=_randn(name, (T, E)).to(device), bias=_bias(name, E).to(device), topk=K,
                             is_padding=mask().to(device))
        cases.append(Case("padding", name, f"{label} rows padded", build))

    def changing(device, name="padding/mask-and-bias-change"):
        return CaseInput(gating_output=_randn(name, (T, E)).to(device), bias=_bias(name, E).to(device), topk=K,
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
