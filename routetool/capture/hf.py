"""Record router inputs and outputs of HF transformers MoE models through forward hooks.

Supported router families (transformers >= 5, where every router module returns
``(router_logits, topk_weights, topk_indices)``):

* ``deepseek_v3`` and ``glm4_moe`` (and Kimi-K2, a DeepSeek-V3 config with 384 experts):
  sigmoid scores, ``e_score_correction_bias`` for selection, top-k weights renormalised
  (``norm_topk_prob``) with HF's ``+ 1e-20`` in the denominator, times
  ``routed_scaling_factor``. Group-limited routing (``n_group > 1`` with
  ``topk_group < n_group``) is not the MuseSpark1x router and is refused.
* ``qwen3_moe`` and ``mixtral``: softmax over the experts, no bias, route_scale 1; Mixtral
  always renormalises, Qwen3-MoE when ``norm_topk_prob`` is set. When it is not, the
  recorded weights are the raw top-k probabilities: the trace says so in its
  ``weights_semantics`` metadata (``unnormalized``), and replay compares like with like.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from routetool.errors import RouteToolError
from routetool.trace import LayerArrays, RouterConfig, TraceMeta

_LAYER_IN_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class RouterFamily:
    """How a transformers architecture routes, in routetool's terms."""

    name: str
    normalization: str
    has_bias: bool


FAMILIES = {
    "deepseek_v3": RouterFamily("deepseek_v3", "sigmoid", True),
    "kimi_k2": RouterFamily("deepseek_v3", "sigmoid", True),
    "glm4_moe": RouterFamily("glm4_moe", "sigmoid", True),
    "qwen3_moe": RouterFamily("qwen3_moe", "softmax", False),
    "mixtral": RouterFamily("mixtral", "softmax", False),
}


def router_config_for(config) -> tuple[RouterFamily, RouterConfig, str]:
    """Router family, parameters and weight semantics of a transformers model config.

    Returns:
        ``(family, router, weights_semantics)`` with semantics ``"renormalized"`` or
        ``"unnormalized"``.

    Raises:
        RouteToolError: an unsupported ``model_type``, or group-limited routing.
    """
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise RouteToolError(f"model_type {model_type!r} is not supported",
                             fix=f"supported: {', '.join(sorted(FAMILIES))}")
    if family.normalization == "sigmoid":
        n_group, topk_group = getattr(config, "n_group", 1) or 1, getattr(config, "topk_group", 1) or 1
        if n_group > 1 and topk_group < n_group:
            raise RouteToolError(
                f"group-limited routing (n_group={n_group}, topk_group={topk_group}) is not the MuseSpark1x router",
                fix="set n_group=1 and topk_group=1 in the config to record plain top-k routing",
            )
        num_experts = config.n_routed_experts
        renorm = bool(getattr(config, "norm_topk_prob", True))
        router = RouterConfig(
            num_experts=num_experts,
            topk=config.num_experts_per_tok,
            route_scale=float(getattr(config, "routed_scaling_factor", 1.0)),
            router_score_normalization="sigmoid",
            router_score_division_eps=1e-20 if renorm else None,
        )
    else:
        num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts")
        renorm = True if family.name == "mixtral" else bool(getattr(config, "norm_topk_prob", False))
        router = RouterConfig(num_experts=num_experts, topk=config.num_experts_per_tok, route_scale=1.0,
                              router_score_normalization="softmax")
    return family, router, "renormalized" if renorm else "unnormalized"


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
        RouteToolError: an unsupported model, or a model without router modules.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.family, self.router, self.weights_semantics = router_config_for(model.config)
        self.modules = router_modules(model)
        if not self.modules:
            raise RouteToolError(f"no router modules found in {type(model).__name__}",
                                 fix="the model must be a supported transformers MoE model")
        self._logits: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.modules}
        self._ids: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.modules}
        self._weights: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.modules}
        self._handles = []

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            logits, weights, ids = output
            self._logits[layer].append(logits.detach().reshape(-1, logits.shape[-1]).to("cpu", copy=True))
            self._weights[layer].append(weights.detach().reshape(-1, weights.shape[-1]).float().to("cpu", copy=True))
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
            extra={"weights_semantics": self.weights_semantics, "capture": f"routetool.capture.hf ({self.family.name})"},
        )
        return meta, layers
