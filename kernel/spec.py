"""The router's parameters, described once: :class:`RouterSpec`.

One router is a number of routed experts (E), the experts picked per token (K), the scoring
function, an optional multiplier on the logits, an optional eps in the weights' denominator and
the factor on the weights (``route_scale``, a.k.a. ``routed_scaling_factor``), and, beyond the
MuseSpark1x router, the semantics production models use: group-limited selection (DeepSeek-V3's
``n_group`` / ``topk_group``), weights without renormalization (``norm_topk_prob=False``: Qwen2-MoE,
OLMoE) and the scoring functions ``sqrtsoftplus`` (DeepSeek-V4) and ``topk_then_softmax``
(gpt-oss: top-k on the logits, softmax over the picks). The semantics of each are in
:mod:`routetool_kernels.reference` (docs/semantics.md). A spec validates itself
(:meth:`RouterSpec.problems`), reads and writes the trace metadata that carries it
(:meth:`RouterSpec.to_metadata`, :meth:`RouterSpec.from_metadata`, docs/trace-format.md),
gives the keyword arguments of the seed's signature (:meth:`RouterSpec.kernel_kwargs`) and the
report's one-line description (:meth:`RouterSpec.describe`). Every field carries metadata
(:data:`FIELD_INFO`): its metadata key, command-line option, help and fix texts.

The MuseSpark1x kernels implement the seed's semantics only (:meth:`RouterSpec.beyond_seed` names
what a spec asks beyond them): a kernel with the seed's signature rejects the keywords that
:meth:`RouterSpec.kernel_kwargs` passes for grouping and ``norm_topk_prob`` (``TypeError``) and
the scoring functions it does not know (``ValueError``), which the contract counts as a
rejection, documented when the kernel's docstring names the option.

Standard library only: the trace readers, the recorder and the command line read it without
importing torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import ClassVar

MAX_EXPERTS = 1 << 20
"""Largest expert count a spec may describe (traces, dumps, options): 1,048,576
(also :data:`routetool.io.limits.MAX_EXPERTS`)."""

NORMALIZATIONS = ("sigmoid", "softmax", "sqrtsoftplus", "topk_then_softmax")
"""The values of ``router_score_normalization`` (the scoring function; docs/semantics.md): ``sigmoid``
and ``softmax`` over the experts (the seed's), ``sqrtsoftplus`` (``sqrt(softplus(x))``,
DeepSeek-V4) and ``topk_then_softmax`` (top-k on the logits, softmax over the picks: gpt-oss)."""
TOPK_METHODS = ("noaux_tc", "group_limited_greedy")
"""The values of ``topk_method`` (DeepSeek's config key), how group-limited routing scores a group:
``noaux_tc`` (the default, DeepSeek-V3: the sum of its two best keys) or ``group_limited_greedy``
(DeepSeek-V2: its best score)."""
SEED_NORMALIZATIONS = NORMALIZATIONS[:2]
"""The scoring functions of the seed's semantics (and of the MuseSpark1x kernels)."""

PLAIN_INT = re.compile(r"[-+]?[0-9]+")
"""A plain decimal integer: ASCII digits with an optional sign, nothing else (no ``_``, spaces
or other scripts' digits)."""
PLAIN_FLOAT = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
"""A plain decimal number: as :data:`PLAIN_INT`, with a decimal point and an exponent."""
SPECIAL_FLOAT = re.compile(r"[-+]?(?:nan|inf|infinity)", re.IGNORECASE)
"""``nan``, ``inf`` and ``infinity`` as ``repr(float)`` writes them (any case, optional sign)."""

PLAIN_NUMBER_FIX = ("write the value as a plain decimal number (ASCII digits 0-9, e.g. 8 or 2.5; no underscores, "
                    "spaces or other scripts' digits)")
PLAIN_INT_FIX = ("write the value as a plain decimal integer (ASCII digits 0-9, e.g. 8; no decimal point, "
                 "underscores, spaces or other scripts' digits)")
METADATA_FIX = "fix the router parameters in the metadata"


def _info(kind: str, option: str, help: str, *, required: tuple[str, str] | None = None, fix: str = "",
          examples: tuple = (), choices: tuple[str, ...] = ()) -> dict:
    """A field's metadata (see :data:`FIELD_INFO`)."""
    return {"kind": kind, "option": option, "help": help, "required": required, "fix": fix, "examples": examples,
            "choices": choices}


@dataclass(frozen=True, repr=False)
class RouterSpec:
    """The parameters of one router, shared by every MoE layer of a model.

    Constructing a spec checks nothing (a reader builds one from what it read, then says what is
    wrong with it); :meth:`problems` is the one validation.

    Attributes:
        num_experts: routed experts per layer (E), ``1 <= E <=`` :data:`MAX_EXPERTS`.
        topk: experts picked per token (K), ``1 <= K <= E``.
        route_scale: factor on the weights (``routed_scaling_factor``), finite, > 0.
        router_score_normalization: the scoring function, one of :data:`NORMALIZATIONS`.
        router_output_multiplier: optional finite factor on the logits before normalization.
        router_score_division_eps: optional finite term >= 0 added to the weights' denominator.
        n_group: expert groups of group-limited routing, or None (off); E must divide into them.
        topk_group: groups a token may pick from, ``1 <= topk_group <= n_group``, or None (off);
            set together with ``n_group``. A group's score is the sum of its two best selection
            keys (DeepSeek-V3's ``noaux_tc``).
        topk_method: ``group_limited_greedy``: a group's score is its best key (DeepSeek-V2), set with
            the grouping; None (off) or ``noaux_tc``: the sum of its two best (stored as None).
        norm_topk_prob: False: the weights are the picked scores times ``route_scale``, not
            renormalised (Qwen2-MoE's and OLMoE's ``norm_topk_prob=False``); None (off) or True:
            renormalised, as the seed (True is stored as None, so that one router has one spec).
    """

    num_experts: int = field(metadata=_info(
        "int", "--experts", "Routed experts per layer (E).",
        required=("num_experts=<E>", "E, the routed experts per layer: gating_output's columns"), examples=(8, 256)))
    topk: int = field(metadata=_info(
        "int", "--topk", "Experts per token (K <= E).",
        required=("topk=<K>", "K, the experts picked per token, 1 <= K <= num_experts"), examples=(1, 8)))
    route_scale: float = field(default=1.0, metadata=_info(
        "float", "--route-scale", "routed_scaling_factor (finite, > 0).",
        required=("route_scale=<factor>", "the factor on the renormalised weights, routed_scaling_factor, "
                                          "finite and > 0; 1 for none"),
        fix="write a finite number > 0 (1 for no scaling)", examples=(1.0, 2.5)))
    router_score_normalization: str = field(default="sigmoid", metadata=_info(
        "str", "--normalization", "The scoring function (docs/semantics.md).", examples=NORMALIZATIONS,
        choices=NORMALIZATIONS))
    router_output_multiplier: float | None = field(default=None, metadata=_info(
        "float?", "--multiplier", "router_output_multiplier (default: none).",
        fix="write a finite number, or leave the key out for no multiplier", examples=(None, 0.5)))
    router_score_division_eps: float | None = field(default=None, metadata=_info(
        "float?", "--eps", "router_score_division_eps (default: none).",
        fix="write a finite number >= 0, or leave the key out for no eps", examples=(None, 1e-20)))
    n_group: int | None = field(default=None, metadata=_info(
        "int?", "--n-group", "Expert groups of group-limited routing (default: none)."))
    topk_group: int | None = field(default=None, metadata=_info(
        "int?", "--topk-group", "Groups a token may pick from (default: none)."))
    topk_method: str | None = field(default=None, metadata=_info(
        "str?", "--topk-method", "How groups are scored: noaux_tc (top-2 sum, default) or group_limited_greedy "
        "(best score).", examples=(None, "group_limited_greedy"), choices=TOPK_METHODS))
    norm_topk_prob: bool | None = field(default=None, metadata=_info(
        "bool?", "--norm-topk-prob", "false: weights not renormalised over the picks (default: renormalised).",
        examples=(None, False)))

    KERNEL_KEYWORDS: ClassVar[tuple[str, ...]] = (
        "topk", "route_scale", "router_output_multiplier", "router_score_normalization", "router_score_division_eps")
    """The router's keyword arguments of the seed's signature, in its order
    (``fn(gating_output, bias, topk, route_scale, ...)``)."""
    DOCUMENT_KEYS: ClassVar[tuple[str, ...]] = (
        "num_experts", "topk", "route_scale", "router_score_normalization", "router_output_multiplier",
        "router_score_division_eps")
    """The fields a report's JSON ``router`` object always holds; later fields only when set."""
    GROUPING: ClassVar[tuple[str, ...]] = ("n_group", "topk_group")
    BEYOND_SEED: ClassVar[tuple[str, ...]] = ("n_group", "topk_group", "topk_method", "norm_topk_prob")
    """The fields that are not keywords of the seed's signature: :meth:`kernel_kwargs` passes each only when set."""

    def __post_init__(self) -> None:
        if self.norm_topk_prob is True:  # the seed's weights: one spelling per router
            object.__setattr__(self, "norm_topk_prob", None)
        if self.topk_method == TOPK_METHODS[0]:  # the default group score
            object.__setattr__(self, "topk_method", None)

    # -- validation ------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Why this router is impossible, one phrase each (empty when it is fine), e.g.
        ``"topk=9 must be in [1, num_experts=8]"`` or ``"route_scale=0.0 must be finite and > 0"``."""
        problems = []
        if not 1 <= self.num_experts <= MAX_EXPERTS:
            problems.append(f"num_experts={self.num_experts:,} must be in [1, {MAX_EXPERTS:,}]")
        if not 1 <= self.topk <= max(self.num_experts, 1):
            problems.append(f"topk={self.topk} must be in [1, num_experts={self.num_experts}]")
        if not (math.isfinite(self.route_scale) and self.route_scale > 0):
            problems.append(f"route_scale={self.route_scale} must be finite and > 0")
        if self.router_score_normalization not in NORMALIZATIONS:
            problems.append(f"router_score_normalization={self.router_score_normalization!r} must be "
                            f"{', '.join(NORMALIZATIONS[:-1])} or {NORMALIZATIONS[-1]}")
        if self.router_output_multiplier is not None and not math.isfinite(self.router_output_multiplier):
            problems.append("router_output_multiplier must be finite")
        eps = self.router_score_division_eps
        if eps is not None and not (math.isfinite(eps) and eps >= 0):
            problems.append(f"router_score_division_eps={eps} must be finite and >= 0")
        problems.extend(self._grouping_problems())
        if self.topk_method is not None and self.topk_method not in TOPK_METHODS:
            problems.append(f"topk_method={self.topk_method!r} must be noaux_tc or group_limited_greedy")
        elif self.topk_method is not None and not self.grouped:
            problems.append(f"topk_method={self.topk_method} scores groups: set n_group and topk_group with it")
        if self.norm_topk_prob not in (None, False):
            problems.append(f"norm_topk_prob={self.norm_topk_prob!r} must be true or false")
        if self.router_score_normalization == "topk_then_softmax":
            for name in ("norm_topk_prob", "router_score_division_eps"):
                if getattr(self, name) is not None:
                    problems.append(f"{name}={getattr(self, name)} must be unset under topk_then_softmax "
                                    "(its weights are a softmax over the picks)")
        return problems

    def _grouping_problems(self) -> list[str]:
        groups, picked = self.n_group, self.topk_group
        if groups is None and picked is None:
            return []
        if groups is None or picked is None:
            return ["n_group and topk_group must be set together"]
        if not 1 <= groups <= max(self.num_experts, 1) or self.num_experts % groups:
            return [f"n_group={groups} must divide num_experts={self.num_experts} into equal groups"]
        problems = []
        if not 1 <= picked <= groups:
            problems.append(f"topk_group={picked} must be in [1, n_group={groups}]")
        elif self.topk > picked * (self.num_experts // groups):
            problems.append(f"topk={self.topk} must be at most the {picked * (self.num_experts // groups)} experts "
                            f"of topk_group={picked} groups")
        return problems

    @property
    def grouped(self) -> bool:
        """Whether the spec sets group-limited routing (``n_group`` / ``topk_group``)."""
        return self.n_group is not None or self.topk_group is not None

    def beyond_seed(self) -> list[str]:
        """What this spec asks beyond the seed's semantics (which the MuseSpark1x kernels implement),
        in field order: ``n_group`` (group-limited routing), the scoring function when it is not
        sigmoid or softmax (``sqrtsoftplus``, ``topk_then_softmax``), ``norm_topk_prob`` (weights
        not renormalised). A kernel that rejects such a spec documents it by naming these words
        in its docstring (:func:`routetool.engine.contract.rejection_documented`)."""
        out = ["n_group"] if self.grouped else []
        if self.router_score_normalization not in SEED_NORMALIZATIONS:
            out.append(self.router_score_normalization)
        if self.norm_topk_prob is not None:
            out.append("norm_topk_prob")
        return out

    def unsupported(self) -> str | None:
        """Why the reference cannot route this spec, or None: it routes every field today (a new
        field's refusal goes here until the reference routes it)."""
        return None

    # -- the kernels' call -----------------------------------------------------------------------
    def kernel_kwargs(self) -> dict[str, object]:
        """Keyword arguments for a routing function with the seed's signature (:data:`KERNEL_KEYWORDS`);
        and each field of :data:`BEYOND_SEED` that is set (``n_group``, ``topk_group``,
        ``norm_topk_prob``), which the seed's signature rejects (``TypeError``)."""
        out = {name: getattr(self, name) for name in self.KERNEL_KEYWORDS}
        out.update((name, getattr(self, name)) for name in self.BEYOND_SEED if getattr(self, name) is not None)
        return out

    @classmethod
    def call_defaults(cls) -> dict[str, object]:
        """The defaults of the seed's signature for its optional router keywords (all of
        :data:`KERNEL_KEYWORDS` after ``topk`` and ``route_scale``, which it requires): each
        field's default, e.g. ``{"router_output_multiplier": None, ...}``."""
        return {f.name: f.default for f in fields(cls) if f.name in cls.KERNEL_KEYWORDS[2:]}

    @classmethod
    def call_values(cls, values) -> tuple:
        """The router arguments of one call, in :data:`KERNEL_KEYWORDS` order and coerced to each
        field's kind (``int``, ``float``, ``str``; None stays None where the field is optional):
        the form the recorder keys call sites by and passes to its op.

        Args:
            values: a mapping holding every name of :data:`KERNEL_KEYWORDS` (a call's bound
                arguments), or a sequence of their values in that order.

        Raises:
            KeyError: a mapping without one of the names. ValueError, TypeError: a value that its
                kind cannot take.
        """
        if isinstance(values, Mapping):
            values = [values[name] for name in cls.KERNEL_KEYWORDS]
        return tuple(None if v is None and optional else convert(v)
                     for (convert, optional), v in zip(_CALL_KINDS, values, strict=True))

    @classmethod
    def from_call(cls, num_experts: int, values) -> RouterSpec:
        """The spec of a call of the seed's signature on ``num_experts`` columns; ``values`` as for
        :meth:`call_values`. Checks nothing (see :meth:`problems`)."""
        return cls(num_experts=num_experts, **dict(zip(cls.KERNEL_KEYWORDS, cls.call_values(values))))

    # -- trace metadata (docs/trace-format.md) -----------------------------------------------------
    def to_metadata(self) -> dict[str, str]:
        """The trace ``__metadata__`` strings of this spec: ``num_experts``, ``topk``, ``route_scale``
        (``repr`` of the float), ``router_score_normalization``, and each optional field only when set."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            kind = f.metadata["kind"].rstrip("?")
            out[f.name] = repr(float(value)) if kind == "float" else str(value).lower() if kind == "bool" else str(value)
        return out

    @classmethod
    def from_metadata(cls, raw: Mapping[str, str]) -> RouterSpec:
        """The spec a trace's ``__metadata__`` describes, checked (the inverse of :meth:`to_metadata`).
        ``router_score_normalization`` defaults to sigmoid; a key left out is its field's default
        (a trace written before a field existed reads as it did); other keys are ignored.

        Raises:
            SpecError: a required key (num_experts, topk, route_scale) missing; a value that is not a
                plain decimal number (``2_5``, non-ASCII digits) or not finite; an empty value; or an
                impossible router (:meth:`problems`). ``.key`` names the key when there is one.
        """
        values = {}
        for f in fields(cls):
            text = raw.get(f.name)
            kind = f.metadata["kind"]
            if kind.startswith("str"):  # (its value is checked by problems())
                values[f.name] = f.default if text is None else text
            elif text is None:
                if not kind.endswith("?"):
                    add, meaning = f.metadata["required"]
                    raise SpecError(f"metadata key {f.name!r} is missing", key=f.name,
                                    fix=f"add {add} to the metadata: {meaning}; see docs/trace-format.md")
                values[f.name] = None
            elif kind.startswith("bool"):
                values[f.name] = _read_bool(f.name, text)
            else:
                values[f.name] = _read_number(f.name, text, kind, f.metadata["fix"])
        spec = cls(**values)
        problems = spec.problems()
        if problems:
            raise SpecError("; ".join(problems), fix=METADATA_FIX)
        return spec

    @classmethod
    def metadata_keys(cls) -> frozenset[str]:
        """Every metadata key a spec reads or writes."""
        return frozenset(f.name for f in fields(cls))

    # -- what reports show -------------------------------------------------------------------------
    def document(self) -> dict[str, object]:
        """The JSON ``router`` object: :data:`DOCUMENT_KEYS` always, a later field only when set."""
        out = {name: getattr(self, name) for name in self.DOCUMENT_KEYS}
        out.update((f.name, getattr(self, f.name)) for f in fields(self)
                   if f.name not in out and getattr(self, f.name) is not None)
        return out

    def describe(self) -> str:
        """The report header's router line, e.g.
        ``E=256 topk=8 sigmoid route_scale=2.5 multiplier=None eps=1e-20``."""
        text = (f"E={self.num_experts} topk={self.topk} {self.router_score_normalization} "
                f"route_scale={self.route_scale:g} multiplier={self.router_output_multiplier} "
                f"eps={self.router_score_division_eps}")
        if self.grouped:
            text += f" n_group={self.n_group} topk_group={self.topk_group}"
        if self.topk_method is not None:
            text += f" {self.topk_method}"
        if self.norm_topk_prob is not None:
            text += f" norm_topk_prob={self.norm_topk_prob}"
        return text

    def __repr__(self) -> str:
        """``RouterSpec(num_experts=8, topk=2, ...)``: every field, those of :data:`BEYOND_SEED` only when set."""
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                          if f.name not in self.BEYOND_SEED or getattr(self, f.name) is not None)
        return f"{type(self).__name__}({shown})"

    def differences(self, other: RouterSpec) -> list[str]:
        """The fields on which ``other`` routes differently from this spec, in field order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


MUSESPARK1X = RouterSpec(num_experts=256, topk=8, route_scale=2.5)
"""MuseSpark1x's router: 256 routed experts, top-8, sigmoid scores, ``routed_scaling_factor`` 2.5."""


class SpecError(ValueError):
    """A router spec that cannot be read or is impossible.

    Attributes:
        problem: what is wrong, one line (also ``str(error)``).
        key: the metadata key it concerns, or None.
        fix: what to do about it.
    """

    def __init__(self, problem: str, *, key: str | None = None, fix: str = "") -> None:
        super().__init__(problem)
        self.problem, self.key, self.fix = problem, key, fix


def _read_bool(key: str, text: str) -> bool:
    """A metadata boolean: ``true`` or ``false`` (any case), read strictly.

    Raises:
        SpecError: any other text.
    """
    if isinstance(text, str) and text.lower() in ("true", "false"):
        return text.lower() == "true"
    raise SpecError(f"metadata {key}={text!r} is not true or false", key=key,
                    fix="write true or false, or leave the key out for the default")


def _read_number(key: str, text: str, kind: str, finite_fix: str) -> int | float:
    """A metadata number of ``kind`` (``int``/``float``, ``?`` when optional), read strictly.

    Raises:
        SpecError: not a plain decimal (:data:`PLAIN_INT`, :data:`PLAIN_FLOAT`), empty, or not finite.
    """
    optional = kind.endswith("?")
    if kind.startswith("int"):
        if isinstance(text, str) and PLAIN_INT.fullmatch(text):
            try:
                return int(text)
            except ValueError:  # more digits than Python converts
                pass
        raise SpecError(f"metadata {key}={text!r} is not a plain decimal integer", key=key, fix=PLAIN_INT_FIX)
    if text == "":
        raise SpecError(f"metadata {key}='' is empty, not a number", key=key,
                        fix="write a plain decimal number" + (", or leave the key out for none" if optional else ""))
    if not isinstance(text, str) or not (PLAIN_FLOAT.fullmatch(text) or SPECIAL_FLOAT.fullmatch(text)):
        raise SpecError(f"metadata {key}={text!r} is not a plain decimal number", key=key, fix=PLAIN_NUMBER_FIX)
    value = float(text)
    if not math.isfinite(value):
        raise SpecError(f"metadata {key}={text!r} is not finite", key=key, fix=finite_fix)
    return value


FIELD_INFO: dict[str, Mapping[str, object]] = {f.name: f.metadata for f in fields(RouterSpec)}
"""Field name -> its metadata: ``kind`` (``int``, ``float``, ``str``, ``bool``; ``?`` when optional),
``option`` (the command-line option), ``help``, ``required`` (for a required metadata key: what
to add and its meaning), ``fix`` (for a value that is not finite), ``choices`` (a text field's
values) and ``examples`` (values a test
suite varies it over)."""

_KIND_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
_CALL_KINDS = tuple((_KIND_TYPES[FIELD_INFO[name]["kind"].rstrip("?")], FIELD_INFO[name]["kind"].endswith("?"))
                    for name in RouterSpec.KERNEL_KEYWORDS)
"""Per keyword of :data:`RouterSpec.KERNEL_KEYWORDS`: its Python type and whether it may be None."""


def schema_arguments() -> str:
    """The router's arguments in a ``torch.library`` schema, from :data:`FIELD_INFO`:
    ``"int topk, float route_scale, float? router_output_multiplier, ..."``."""
    return ", ".join(f"{FIELD_INFO[name]['kind']} {name}" for name in RouterSpec.KERNEL_KEYWORDS)
