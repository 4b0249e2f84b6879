"""Record router inputs and outputs of HF transformers MoE models through forward hooks.

Supported router families (transformers >= 5, where every router module returns
``(router_logits, topk_weights, topk_indices)``), each read into its router spec
(docs/semantics.md):

* ``deepseek_v3`` and ``glm4_moe`` (and Kimi-K2, a DeepSeek-V3 config with 384 experts):
  sigmoid scores, ``e_score_correction_bias`` for selection, group-limited selection when
  ``n_group > 1`` and ``topk_group < n_group`` (DeepSeek-V3's real config: 8 and 4), top-k
  weights renormalised (``norm_topk_prob``) with HF's ``+ 1e-20`` in the denominator, times
  ``routed_scaling_factor``.
* ``deepseek_v2``: softmax scores, ``topk_method`` ``greedy`` (DeepSeek-V2-Lite) or
  ``group_limited_greedy`` (DeepSeek-V2: the best ``topk_group`` of ``n_group`` groups by their
  best score), weights not renormalised, times ``routed_scaling_factor``.
* ``qwen3_moe``, ``qwen3_next``, ``qwen2_moe``, ``olmoe`` and ``mixtral``: softmax over the
  experts, no bias, route_scale 1; Mixtral always renormalises, the others when
  ``norm_topk_prob`` is set (Qwen3-MoE and Qwen3-Next checkpoints set it, Qwen2-MoE and OLMoE
  do not).
* ``gpt_oss``: top-k of the logits (the router's linear bias is part of them), softmax over the
  picks (``topk_then_softmax``).

Besides the recorder (:class:`HFRouterRecorder`) this module builds the models and inputs of
``routetool capture hf`` (:func:`small_config`, :func:`load_config`, :func:`build_model`,
:func:`load_checkpoint`, :func:`encode_text`, :func:`prompt_batch`) and runs a capture
(:func:`capture_hf`). transformers is imported only inside the functions that need it
(``pip install routetool[capture]``).

Weight semantics, written to the trace's ``weights_semantics`` metadata:

* ``renormalized``: the router's own weights (``route_scale * s_i / (sum of the picked s + eps)``,
  or a softmax over the picked logits under ``topk_then_softmax``);
* ``unnormalized``: ``topk_weights = route_scale * s_i`` (no division by the picks' sum), as
  the models compute them with ``norm_topk_prob=False`` (the router spec then says
  ``norm_topk_prob=False`` too). The ids follow the same selection rule either way.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from routetool.errors import RouteToolError, install_extra
from routetool.io.paths import path_kind
from routetool.io.jsonstrict import load_file
from routetool.io.trace import (
    WEIGHTS_SEMANTICS,
    LayerArrays,
    RouterConfig,
    TraceMeta,
    router_config_errors,
)

_LAYER_IN_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class RouterFamily:
    """How a transformers architecture routes, in routetool's terms.

    Attributes:
        name: the family (its model_type). normalization: the scoring function.
        has_bias: a selection bias (``e_score_correction_bias``).
        experts_keys: the config keys of the routed experts, the first present one counts.
        renormalize: True/False: whatever the config says (Mixtral always, DeepSeek-V2 never,
            gpt-oss: a softmax over the picks); None: the config's ``norm_topk_prob``, with
            ``norm_default`` where it is unset.
        scale_key: the config key of ``route_scale`` (None: 1). grouped: the config's
            ``n_group``/``topk_group`` are read (DeepSeek-V3's noaux_tc).
    """

    name: str
    normalization: str
    has_bias: bool
    experts_keys: tuple[str, ...] = ("num_experts",)
    renormalize: bool | None = None
    norm_default: bool = True
    scale_key: str | None = None
    grouped: bool = False


_NOAUX_TC = dict(normalization="sigmoid", has_bias=True, experts_keys=("n_routed_experts",),
                 scale_key="routed_scaling_factor", grouped=True)
FAMILIES = {
    "deepseek_v3": RouterFamily("deepseek_v3", **_NOAUX_TC),
    "kimi_k2": RouterFamily("deepseek_v3", **_NOAUX_TC),
    "glm4_moe": RouterFamily("glm4_moe", **_NOAUX_TC),
    "deepseek_v2": RouterFamily("deepseek_v2", "softmax", False, ("n_routed_experts", "num_experts"), renormalize=False,
                                scale_key="routed_scaling_factor"),
    "qwen3_moe": RouterFamily("qwen3_moe", "softmax", False, norm_default=False),
    "qwen3_next": RouterFamily("qwen3_next", "softmax", False),
    "qwen2_moe": RouterFamily("qwen2_moe", "softmax", False, norm_default=False),
    "olmoe": RouterFamily("olmoe", "softmax", False, norm_default=False),
    "mixtral": RouterFamily("mixtral", "softmax", False, ("num_local_experts", "num_experts"), renormalize=True),
    "gpt_oss": RouterFamily("gpt_oss", "topk_then_softmax", False, ("num_local_experts", "num_experts"),
                            renormalize=True),
}


_POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                   "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_NON_NEGATIVE_COUNTS = ("n_shared_experts", "first_k_dense_replace")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _config_error(message: str, source: object, key: str | None = None) -> RouteToolError:
    fix = (f"fix {key} in the config (or --set {key}=...)" if key else "fix the config (or --set KEY=VALUE)")
    return RouteToolError(message, path=source, fix=fix)


def check_model_config(config, source: object = None) -> None:
    """Refuse a config whose sizes transformers would fail on (or build nonsense from):
    every size field present must be an integer >= 1 (counts such as ``n_shared_experts``
    >= 0), and the router must be one routetool records (:func:`router_config_for`).

    Args:
        config: a transformers config. source: what to name in errors (a config file,
            ``--arch X``).

    Raises:
        RouteToolError: naming the field, its value and the allowed range.
    """
    for key in _POSITIVE_SIZES + _NON_NEGATIVE_COUNTS:
        value = getattr(config, key, None)
        if value is None:
            continue
        low = 0 if key in _NON_NEGATIVE_COUNTS else 1
        if not _is_int(value) or value < low:
            raise _config_error(f"{key}={value!r} must be an integer >= {low}", source, key)
    router_config_for(config, source)


def router_config_for(config, source: object = None) -> tuple[RouterFamily, RouterConfig, str]:
    """Router family, parameters and weight semantics of a transformers model config.

    Args:
        config: a transformers config. source: what to name in errors.

    Returns:
        ``(family, router, weights_semantics)`` with semantics ``"renormalized"`` or
        ``"unnormalized"`` (:data:`routetool.io.trace.WEIGHTS_SEMANTICS`).

    Raises:
        RouteToolError: an unsupported ``model_type`` or ``topk_method``, or router fields of
            the wrong type or range (expert count < 1, top-k outside [1, experts], a scaling
            factor that is not finite and > 0, ``norm_topk_prob`` not a bool, groups that do
            not divide the experts or hold fewer than top-k).
    """
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise RouteToolError(f"model_type {model_type!r} is not supported", path=source,
                             fix=f"supported: {', '.join(sorted(FAMILIES))}")
    groups = _groups(config, family, source)
    experts_key = next((k for k in family.experts_keys if getattr(config, k, None) is not None), family.experts_keys[0])
    num_experts = getattr(config, experts_key, None)
    topk = getattr(config, "num_experts_per_tok", None)
    if not _is_int(num_experts) or num_experts < 1:
        raise _config_error(f"{experts_key}={num_experts!r} must be an integer >= 1 (routed experts)", source,
                            experts_key)
    if not _is_int(topk) or not 1 <= topk <= num_experts:
        raise _config_error(f"num_experts_per_tok={topk!r} must be an integer in [1, {experts_key}={num_experts}]",
                            source, "num_experts_per_tok")
    renorm = family.renormalize
    if renorm is None:
        renorm = getattr(config, "norm_topk_prob", family.norm_default)
        renorm = family.norm_default if renorm is None else renorm
    if not isinstance(renorm, bool):
        raise _config_error(f"norm_topk_prob={renorm!r} must be true or false", source, "norm_topk_prob")
    scale = 1.0
    if family.scale_key is not None:
        raw = getattr(config, family.scale_key, 1.0)
        raw = 1.0 if raw is None else raw
        if not (isinstance(raw, (int, float)) and not isinstance(raw, bool) and math.isfinite(raw) and raw > 0):
            raise _config_error(f"{family.scale_key}={raw!r} must be a finite number > 0", source, family.scale_key)
        scale = float(raw)
    eps = 1e-20 if renorm and family.normalization == "sigmoid" else None  # HF's denominator + 1e-20
    router = RouterConfig(num_experts=num_experts, topk=topk, route_scale=scale,
                          router_score_normalization=family.normalization, router_score_division_eps=eps,
                          norm_topk_prob=None if renorm else False, **groups)
    problems = router_config_errors(router)
    if problems:
        raise _config_error("; ".join(problems), source)
    return family, router, "renormalized" if renorm else "unnormalized"


def _groups(config, family: RouterFamily, source: object) -> dict[str, int]:
    """The spec's ``n_group``/``topk_group`` of a config: set for group-limited routing (``n_group > 1``
    and ``topk_group < n_group``), empty otherwise (every group kept is plain top-k).

    Raises:
        RouteToolError: a group count that is not an integer >= 1; a DeepSeek-V2 ``topk_method``
            other than ``greedy`` and ``group_limited_greedy``.
    """
    method = None
    if family.name == "deepseek_v2":
        method = getattr(config, "topk_method", "greedy")
        if method in (None, "greedy"):
            return {}
        if method != "group_limited_greedy":
            raise _config_error(f"topk_method={method!r} must be greedy or group_limited_greedy", source,
                                "topk_method")
    elif not family.grouped:
        return {}
    n_group, topk_group = getattr(config, "n_group", 1), getattr(config, "topk_group", 1)
    n_group, topk_group = (1 if n_group is None else n_group), (1 if topk_group is None else topk_group)
    for key, value in (("n_group", n_group), ("topk_group", topk_group)):
        if not _is_int(value) or value < 1:
            raise _config_error(f"{key}={value!r} must be an integer >= 1", source, key)
    if not (n_group > 1 and topk_group < n_group):
        return {}
    return {"n_group": n_group, "topk_group": topk_group, **({"topk_method": method} if method else {})}


def router_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """MoE router modules of ``model`` by layer index (modules named ``...layers.L...``
    whose class name ends in ``TopkRouter``/``TopKRouter``)."""
    found: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls.endswith(("TopkRouter", "TopKRouter")):
            m = _LAYER_IN_NAME.search(name)
            if m is None:
                continue
            found[int(m.group(1))] = module
    return found


_DENSE_LAYER_KEYS = ("num_hidden_layers", "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step",
                     "mlp_only_layers")
"""Config keys that decide which decoder layers of the supported families are MoE layers."""


def _no_moe_layer(model: torch.nn.Module) -> tuple[str, str]:
    """(message, fix) for a supported model none of whose layers is an MoE layer."""
    config = model.config
    keys = ", ".join(f"{k}={getattr(config, k)!r}" for k in _DENSE_LAYER_KEYS if getattr(config, k, None) is not None)
    return (f"{type(model).__name__} has no MoE layer: every decoder layer is dense ({keys})",
            "leave at least one layer sparse, e.g. first_k_dense_replace below num_hidden_layers, or fewer "
            "mlp_only_layers")


class HFRouterRecorder:
    """Context manager that records every router call of a transformers MoE model.

    Each forward pass of the model is one step; per layer the recorder keeps the router
    logits (``gating_output``, in the dtype the model produced), the model's own top-k ids
    and weights, and the step boundaries. The bias is read from the router module
    (``e_score_correction_bias``) when the family has one.

    Example::

        with HFRouterRecorder(model) as rec:
            model.generate(input_ids, max_new_tokens=8)
        meta, layers = rec.trace(model_name="...", provenance="...")

    Raises:
        RouteToolError: an unsupported model, or a model without router modules (every layer
            dense; named as ``source``: a config file, ``--arch X``).
    """

    def __init__(self, model: torch.nn.Module, source: object = None):
        self.model = model
        self.family, self.router, self.weights_semantics = router_config_for(model.config)
        self.modules = router_modules(model)
        if not self.modules:
            message, fix = _no_moe_layer(model)
            raise RouteToolError(message, path=source, fix=fix)
        self._logits: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.modules}
        self._ids: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.modules}
        self._weights: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.modules}
        self._handles = []

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            logits, weights, ids = output
            self._logits[layer].append(logits.detach().reshape(-1, logits.shape[-1]).to("cpu", copy=True))
            w = weights.detach().reshape(-1, weights.shape[-1])
            if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                w = w.float()
            # kept in the model's dtype, so that replay's tolerance matches its rounding
            self._weights[layer].append(w.to("cpu", copy=True))
            self._ids[layer].append(ids.detach().reshape(-1, ids.shape[-1]).to("cpu", torch.int32, copy=True))
        return hook

    def __enter__(self) -> HFRouterRecorder:
        for layer, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def num_steps(self) -> int:
        return min((len(v) for v in self._logits.values()), default=0)

    def trace(self, *, model_name: str, provenance: str) -> tuple[TraceMeta, dict[int, LayerArrays]]:
        """The recording as trace metadata and per-layer tensors for :func:`write_trace`.

        Raises:
            RouteToolError: nothing was recorded.
        """
        if self.num_steps == 0:
            raise RouteToolError("the recorder saw no router call", fix="run a forward pass inside the `with` block")
        if self.weights_semantics not in WEIGHTS_SEMANTICS:  # the trace reader refuses any other value
            raise RouteToolError(f"weights_semantics {self.weights_semantics!r} is not one of "
                                 f"{', '.join(WEIGHTS_SEMANTICS)}", fix="record a supported model")
        layers: dict[int, LayerArrays] = {}
        for layer, module in sorted(self.modules.items()):
            sizes = [t.shape[0] for t in self._logits[layer]]
            bias = None
            if self.family.has_bias and hasattr(module, "e_score_correction_bias"):
                bias = module.e_score_correction_bias.detach().float().cpu().clone()
            layers[layer] = LayerArrays(
                gating_output=torch.cat(self._logits[layer]),
                bias=bias,
                step_offsets=torch.tensor([0] + sizes).cumsum(0),
                topk_ids=torch.cat(self._ids[layer]),
                topk_weights=torch.cat(self._weights[layer]),
            )
        meta = TraceMeta(
            model=model_name,
            router=self.router,
            provenance=provenance,
            extra={"weights_semantics": self.weights_semantics,
                   "capture": f"routetool.capture.hf ({self.family.name})"},
        )
        return meta, layers


# ---------------------------------------------------------------------------------------
# models and inputs for `routetool capture hf`
ARCHS = ("deepseek_v3", "kimi_k2", "glm4_moe", "deepseek_v2", "qwen3_moe", "qwen3_next", "qwen2_moe", "olmoe",
         "gpt_oss", "mixtral")
"""Architectures ``routetool capture hf --arch`` builds from a small config."""

_MLA = dict(q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            num_key_value_heads=4)
"""The small latent attention of the DeepSeek architectures."""
_SMALL = {
    # shared: tiny attention, a byte-sized vocabulary; only the router shape is realistic
    # DeepSeek-V3 as configured: its experts in 8 groups, a token's picks within the best 4
    "deepseek_v3": dict(model_type="deepseek_v3", n_routed_experts=32, num_experts_per_tok=4, n_group=8,
                        topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                        n_shared_experts=1, **_MLA),
    # Kimi-K2 is a DeepSeek-V3 architecture: 384 routed experts, top-8, scaling 2.827, no groups
    "kimi_k2": dict(model_type="deepseek_v3", n_routed_experts=384, num_experts_per_tok=8, n_group=1,
                    topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True, first_k_dense_replace=1,
                    n_shared_experts=1, **_MLA),
    "glm4_moe": dict(model_type="glm4_moe", n_routed_experts=32, num_experts_per_tok=4, n_group=1, topk_group=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, n_shared_experts=1,
                     head_dim=16),
    # DeepSeek-V2-Lite: 64 experts, top-6, greedy, weights not renormalised
    "deepseek_v2": dict(model_type="deepseek_v2", n_routed_experts=64, num_experts_per_tok=6, topk_method="greedy",
                        routed_scaling_factor=1.0, first_k_dense_replace=1, n_shared_experts=1, head_dim=8, **_MLA),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=32, num_experts_per_tok=4, norm_topk_prob=True,
                      head_dim=16),
    # Qwen3-Next / Qwen3.5: 512 experts, top-10, renormalised; one full-attention layer among linear ones
    "qwen3_next": dict(model_type="qwen3_next", num_experts=512, num_experts_per_tok=10, norm_topk_prob=True,
                       head_dim=16, shared_expert_intermediate_size=16,
                       layer_types=["linear_attention", "full_attention", "linear_attention"]),
    # Qwen2-MoE and OLMoE as their checkpoints are configured: norm_topk_prob false
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                      shared_expert_intermediate_size=16),
    "olmoe": dict(model_type="olmoe", num_experts=64, num_experts_per_tok=8, norm_topk_prob=False),
    # gpt-oss-20b's router: 32 experts, top-4, softmax over the picked logits
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=32, num_experts_per_tok=4, head_dim=16),
    "mixtral": dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, head_dim=16),
}
_SMALL_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _one_line(exc: BaseException) -> str:
    """``Type: message`` of an exception, on one line (transformers' messages span several)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextlib.contextmanager
def _quiet_transformers(transformers):
    """transformers' own warnings off (they would add lines before routetool's one-line error;
    the config checks here report the same problems)."""
    logging = transformers.utils.logging
    previous = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(previous)


def require_transformers():
    """Import transformers, or say how to install it.

    Raises:
        RouteToolError: transformers is not installed.
    """
    try:
        import transformers
    except ImportError:
        raise RouteToolError("transformers is not installed",
                             fix=install_extra("capture") + " (or pip install 'transformers>=5')") from None
    return transformers


def small_config(arch: str, **overrides):
    """A small transformers config of ``arch`` (one of :data:`ARCHS`): a realistic router
    (expert count, top-k, scaling, bias) on a tiny model (hidden 64, 3 layers, 256-token
    vocabulary). ``overrides`` replace any config field (e.g. ``norm_topk_prob=False``).

    Raises:
        RouteToolError: unknown arch, transformers missing, or a field the config rejects.
    """
    if arch not in _SMALL:
        raise RouteToolError(f"unknown --arch {arch!r}", fix=f"choose among {', '.join(ARCHS)}")
    transformers = require_transformers()
    fields = {**_SMALL_COMMON, **_SMALL[arch], **overrides}
    model_type = fields.pop("model_type")
    try:
        with _quiet_transformers(transformers):
            return transformers.AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # noqa: BLE001 - TypeError, ValueError, strict-dataclass errors ...
        raise RouteToolError(f"cannot build a {arch} config ({_one_line(exc)})", path=f"--arch {arch}",
                             fix="check the --set values") from None


def load_config(path: str | Path, **overrides):
    """A transformers config from a ``config.json`` file (or a folder holding one).

    Raises:
        RouteToolError: missing/unreadable file, not JSON (or a key given twice in one
            object), no ``model_type``, or a model
            type transformers does not know.
    """
    transformers = require_transformers()
    p = Path(path)
    file = p / "config.json" if path_kind(p) == "folder" else p
    if path_kind(file) != "file":
        raise RouteToolError("no such config file", path=file, fix="name a config.json or a folder holding one")
    fields = load_file(file, fix="name a transformers config.json")
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise RouteToolError("has no model_type", path=file, fix="name a transformers config.json")
    fields.update(overrides)
    model_type = fields.pop("model_type")
    for key in ("architectures", "transformers_version", "auto_map"):
        fields.pop(key, None)
    try:
        with _quiet_transformers(transformers):
            return transformers.AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # noqa: BLE001 - TypeError, ValueError, KeyError, strict-dataclass ...
        raise RouteToolError(f"transformers cannot build model_type {model_type!r} ({_one_line(exc)})", path=file,
                             fix="fix the config's values (or --set KEY=VALUE), or use a config of a supported "
                                 "MoE model") from None


ROUTER_STD = 0.25
"""Default std of the redrawn router weights of a random-weight model (``--router-std``)."""
BIAS_STD = 0.02
"""Default std of its drawn ``e_score_correction_bias`` (``--bias-std``)."""


def std_problem(option: str, std: object) -> tuple[str, str] | None:
    """(message, fix) when ``std`` is no finite number in [0, :data:`MAX_STD`] for ``option``
    (``--router-std`` or ``--bias-std``), else None."""
    if isinstance(std, (int, float)) and not isinstance(std, bool) and math.isfinite(std) and 0 <= std <= MAX_STD:
        return None
    default = ROUTER_STD if option == "--router-std" else BIAS_STD
    return (f"{option} {std!r} must be a finite number in [0, {MAX_STD:g}]",
            f"e.g. {option} {default:g}, the default; 0 keeps HF's initialisation")


def build_model(config, *, seed: int = 0, router_std: float = ROUTER_STD, bias_std: float = BIAS_STD,
                dtype: torch.dtype = torch.float32, source: object = None) -> torch.nn.Module:
    """A causal-LM of ``config`` with seeded random weights (no network).

    HF initialises routers at std 0.02 and the correction bias at 0, which gives nearly
    uniform scores; trained routers have a spread. So the router weights are redrawn from
    N(0, router_std^2) and, for families with a bias, the bias from N(0, bias_std^2), from a
    generator seeded with ``seed`` (0 keeps HF's initialisation).

    Args:
        config: a transformers config (:func:`small_config`, :func:`load_config`).
        seed: in [0, 2**63 - 1]. router_std / bias_std: finite, in [0, 10].
        dtype: model dtype. source: what to name in errors (a config file, ``--arch X``).

    Raises:
        RouteToolError: an unsupported router family, group-limited routing, impossible
            sizes or router fields (:func:`check_model_config`, checked first), a model too
            large to hold (:func:`check_model_size`, checked before anything is allocated),
            bad seed or std, or any failure of transformers to build the model (in one line).
    """
    transformers = require_transformers()
    check_model_config(config, source)  # refuse impossible configs before building anything
    check_model_size(config, dtype, source)
    if not (isinstance(seed, int) and 0 <= seed <= MAX_SEED):
        raise RouteToolError(f"seed={seed!r} must be an integer in [0, 2**63-1]", fix="e.g. --seed 0")
    for option, std in (("--router-std", router_std), ("--bias-std", bias_std)):
        problem = std_problem(option, std)
        if problem:
            raise RouteToolError(problem[0], fix=problem[1])
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in router_modules(model).values():
                if router_std > 0:
                    module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * router_std)
                bias = getattr(module, "e_score_correction_bias", None)
                if bias_std > 0 and bias is not None:
                    bias.copy_(torch.randn(bias.shape, generator=gen) * bias_std)
    except RouteToolError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the model code raises for a config it cannot build
        raise RouteToolError(f"transformers cannot build the model ({_one_line(exc)})", path=source,
                             fix="check the config's sizes (or the --set values)") from None
    return model


MAX_SEED = 2**63 - 1
"""Largest ``--seed`` (torch generators take 64-bit seeds)."""
MAX_MODEL_LAYERS = 1024
"""Most ``num_hidden_layers`` of a random-weight model (real MoE models have about 100 or fewer;
each layer is a tree of Python modules, so even the size estimate costs time per layer)."""
MAX_MODEL_BYTES = 2**32
"""Largest random-weight model, in bytes of parameters and buffers (4 GiB); lower on a machine
with less than twice that memory (:func:`model_size_limit`)."""


def physical_memory_bytes() -> int | None:
    """The machine's physical memory (``os.sysconf``), or None where the system does not say."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def model_size_limit() -> int:
    """Bytes a random-weight model may take: :data:`MAX_MODEL_BYTES`, or half the physical
    memory when that is less (the forward passes and the recording need the rest)."""
    memory = physical_memory_bytes()
    return MAX_MODEL_BYTES if memory is None else min(MAX_MODEL_BYTES, memory // 2)


def model_size(config, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """``(parameters, bytes)`` of the model :func:`build_model` makes from ``config``: the same
    ``from_config`` call, on the meta device (shapes only, nothing allocated). Bytes count the
    parameters (shared ones once) and the buffers.

    Raises:
        Whatever transformers raises for a config it cannot build.
    """
    transformers = require_transformers()
    with torch.device("meta"), _quiet_transformers(transformers):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    params = list(model.parameters())
    tensors = params + list(model.buffers())
    return sum(p.numel() for p in params), sum(t.numel() * t.element_size() for t in tensors)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def check_model_size(config, dtype: torch.dtype = torch.float32, source: object = None) -> None:
    """Refuse a random-weight model too large to build here, before anything is allocated:
    more than :data:`MAX_MODEL_LAYERS` layers, or parameters and buffers above
    :func:`model_size_limit` (counted by :func:`model_size`).

    Raises:
        RouteToolError: naming the config, the size and the limit; or transformers failing on
            the config (in one line).
    """
    layers = getattr(config, "num_hidden_layers", None)
    if _is_int(layers) and layers > MAX_MODEL_LAYERS:
        raise _config_error(f"num_hidden_layers={layers:,} is above the limit of {MAX_MODEL_LAYERS:,} layers for a "
                            "random-weight model", source, "num_hidden_layers")
    try:
        params, nbytes = model_size(config, dtype)
    except RouteToolError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the model code raises for a config it cannot build
        raise RouteToolError(f"transformers cannot build the model ({_one_line(exc)})", path=source,
                             fix="check the config's sizes (or the --set values)") from None
    limit = model_size_limit()
    if nbytes > limit:
        dtype_name = str(dtype).removeprefix("torch.")
        where = ("the limit for random-weight models" if limit == MAX_MODEL_BYTES
                 else "half of this machine's memory")
        raise RouteToolError(
            f"the model would hold {params:,} parameters, {_size(nbytes)} in {dtype_name}; {where} is {_size(limit)}",
            path=source,
            fix="lower num_hidden_layers, hidden_size, the intermediate sizes, the expert count or vocab_size "
                "(--set KEY=VALUE), or use --dtype bfloat16")
MAX_STD = 10.0
"""Largest ``--router-std`` / ``--bias-std``."""


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "spiece.model",
                    "vocab.txt")


@contextlib.contextmanager
def progress_bars(enabled: bool):
    """transformers' own progress bars (``Loading weights``, checkpoint shards) off while the block
    runs unless ``enabled``, so that ``--no-progress`` silences them as it does routetool's; the
    setting before is restored afterwards."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not enabled:
            hf_logging.enable_progress_bar()


def load_checkpoint(path: str | Path, *, dtype: torch.dtype | str = "auto", tokenizer: str = "auto",
                    overrides: dict | None = None, source: object = None):
    """``(model, tokenizer or None)`` from a local checkpoint folder (no network).

    Args:
        path: a folder saved with ``save_pretrained`` (config.json + weights).
        dtype: model dtype (``"auto"``: the checkpoint's).
        tokenizer: ``auto`` (the checkpoint's tokenizer when the folder has tokenizer files,
            else None), ``checkpoint`` (must load), or ``bytes`` (None: the byte fallback
            of :func:`encode_text`).
        overrides: config fields to replace before the weights load (``--set``), e.g. the
            router's ``n_group``/``topk_group``, ``norm_topk_prob`` or ``topk_method``; a size that
            no longer fits the weights fails their load.
        source: what to name in the config's errors (default: the folder).

    Raises:
        RouteToolError: not a folder with a config.json, an unsupported model or router
            (:func:`check_model_config`), weights that do not load, or a tokenizer that cannot be
            loaded when one is expected.
    """
    transformers = require_transformers()
    p = Path(path)
    if not (path_kind(p) == "folder" and path_kind(p / "config.json") == "file"):
        raise RouteToolError("is not a checkpoint folder (no config.json)", path=p,
                             fix="name a local folder saved with save_pretrained (or use --config/--arch)")
    load_file(p / "config.json", fix="fix the checkpoint's config.json")  # strictly, before transformers reads it
    if tokenizer not in ("auto", "checkpoint", "bytes"):
        raise RouteToolError(f"tokenizer {tokenizer!r} must be auto, checkpoint or bytes", fix="e.g. --tokenizer auto")
    try:
        config = transformers.AutoConfig.from_pretrained(str(p), local_files_only=True)
        for key, value in (overrides or {}).items():
            setattr(config, key, value)
    except Exception as exc:  # noqa: BLE001 - OSError, ValueError, KeyError, strict-dataclass errors ...
        raise RouteToolError(f"cannot read the config ({_one_line(exc)})", path=p / "config.json",
                             fix="check the checkpoint") from None
    check_model_config(config, source or p)
    has_files = any(path_kind(p / name) == "file" for name in _TOKENIZER_FILES)
    tok = None
    if tokenizer == "checkpoint" or (tokenizer == "auto" and has_files):
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - many types for broken tokenizer files
            raise RouteToolError(f"cannot load the checkpoint's tokenizer ({type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''})", path=p,
                                 fix="fix the tokenizer files, or pass --tokenizer bytes") from None
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(p), config=config, local_files_only=True,
                                                                   dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - OSError, ValueError, RuntimeError, safetensors errors ...
        raise RouteToolError(f"cannot load the weights ({_one_line(exc)})", path=p,
                             fix="check that the checkpoint is complete") from None
    return model.eval(), tok


def read_text(path: str | Path) -> str:
    """The input text of a capture: a UTF-8 file, or ``-`` for stdin.

    Raises:
        RouteToolError: a missing file, a directory, a file that cannot be read or is not
            UTF-8 text, or an empty text (naming the file and the fix).
    """
    shown = "<stdin>" if str(path) == "-" else Path(path)
    fix = "give --text a UTF-8 text file (or - for stdin)"
    if str(path) == "-":
        import sys

        stream = getattr(sys.stdin, "buffer", None)
        data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8", "surrogateescape")
    else:
        p = Path(path)
        kind = path_kind(p)
        if kind in ("missing", "dangling link"):
            raise RouteToolError("no such file", path=p, fix=fix)
        if kind == "folder":
            raise RouteToolError("is a directory, not a text file", path=p, fix=fix)
        try:
            data = p.read_bytes()
        except OSError as exc:
            raise RouteToolError(f"cannot read file ({exc.strerror or exc})", path=p, fix="check permissions") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RouteToolError(f"is not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r})", path=shown,
                             fix=fix) from None
    if not text.strip():
        raise RouteToolError("the text is empty", path=shown, fix="give text to run the model on")
    return text


def encode_text(text: str, tokenizer, vocab_size: int) -> list[int]:
    """Token ids of ``text``: the tokenizer's, or UTF-8 bytes (each ``b % vocab_size``) without one.

    Raises:
        RouteToolError: the tokenizer gives ids outside the model's vocabulary.
    """
    if tokenizer is None:
        return [b % vocab_size for b in text.encode("utf-8")]
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if ids and max(ids) >= vocab_size:
        raise RouteToolError(f"the tokenizer gives id {max(ids)} but the model has vocab_size={vocab_size}",
                             fix="use the checkpoint's own tokenizer, or --tokenizer bytes")
    return ids


def prompt_batch(ids: list[int], batch: int, prompt_tokens: int, source: object = None) -> torch.Tensor:
    """``[batch, prompt_tokens]`` int64 prompts: consecutive slices of the token stream.

    Raises:
        RouteToolError: fewer than ``batch * prompt_tokens`` tokens, or sizes < 1.
    """
    if batch < 1 or prompt_tokens < 1:
        raise RouteToolError("--batch and --prompt-tokens must be >= 1", fix="e.g. --batch 4 --prompt-tokens 64")
    need = batch * prompt_tokens
    if len(ids) < need:
        raise RouteToolError(f"the text has {len(ids)} tokens; {batch} prompts of {prompt_tokens} need {need}",
                             path=source, fix="give more text, or lower --batch / --prompt-tokens")
    return torch.tensor(ids[:need], dtype=torch.long).view(batch, prompt_tokens)


def run_model(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int) -> None:
    """One prefill step, then ``max_new_tokens - 1`` greedy decode steps (``max_new_tokens``
    forward passes; one forward pass without generation when 0)."""
    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        if max_new_tokens == 0:
            model(input_ids=input_ids, attention_mask=mask, use_cache=False)
            return
        gen_cfg = getattr(model, "generation_config", None)
        pad = getattr(gen_cfg, "pad_token_id", None)
        if pad is None:
            pad = getattr(model.config, "pad_token_id", None)
        if pad is None:
            eos = getattr(gen_cfg, "eos_token_id", None)
            pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
        model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                       min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)


@dataclass
class HFCapture:
    """What :func:`capture_hf` recorded (rendered by ``routetool capture hf``).

    Attributes:
        out: trace path (empty until written). model_name: the trace's ``model``.
        family: router family. layers: MoE layer indices. router: parameters.
        weights_semantics: ``renormalized`` or ``unnormalized``. batch / prompt_tokens /
        max_new_tokens: the input. tokenizer: ``checkpoint`` or ``bytes``. num_steps: steps
        per layer. tokens_per_layer: rows per layer.
    """

    out: str
    model_name: str
    family: str
    layers: list[int]
    router: RouterConfig
    weights_semantics: str
    batch: int
    prompt_tokens: int
    max_new_tokens: int
    tokenizer: str
    num_steps: int
    tokens_per_layer: int


def capture_hf(model: torch.nn.Module, input_ids: torch.Tensor, *, max_new_tokens: int, model_name: str,
               provenance: str, source: object = None,
               progress: Callable[[int], None] | None = None) -> tuple[TraceMeta, dict[int, LayerArrays]]:
    """Run ``model`` on ``input_ids`` (:func:`run_model`) under :class:`HFRouterRecorder`.

    Args:
        source: what to name when the model fails to run (a config file, ``--arch X``).
        progress: called with 1 after each forward pass (``max(1, max_new_tokens)`` in all).

    Returns:
        ``(meta, layers)`` for :func:`routetool.io.trace.write_trace`.

    Raises:
        RouteToolError: an unsupported model, no router call seen, or any failure of the
            model's own code while it runs (in one line).
    """
    with HFRouterRecorder(model, source) as rec:
        handle = None
        if progress is not None and rec.modules:
            first = rec.modules[min(rec.modules)]
            handle = first.register_forward_hook(lambda *_: progress(1))
        try:
            run_model(model, input_ids, max_new_tokens)
        except RouteToolError:
            raise
        except Exception as exc:  # noqa: BLE001 - the model code failed on this config or input
            raise RouteToolError(f"the model failed to run ({_one_line(exc)})", path=source,
                                 fix="check the config's sizes (or the --set values) and the input sizes") from None
        finally:
            if handle is not None:
                handle.remove()
    return rec.trace(model_name=model_name, provenance=provenance)
