"""A small MoE decoder whose router calls the MuseSpark1x routing function, for proving that the
recorder captures exactly what a model routed: eagerly, under torch.compile and as CUDA-graph
replays (tests/capture/test_capture_model.py on the CPU, tests/capture/test_capture_gpu.py on the GPU).

The routing function is the project's ``tiled`` kernel (:mod:`kernel`) behind a custom op
(``routetool_test::tiled_routing``), so that torch.compile traces the model without a graph
break, as engines register their routing kernels; the model calls it through the module
:data:`ROUTING_MODULE` at call time (``routing.fused_musespark1x_routing``, the seed's
signature), which is what the recorder patches.
"""

from __future__ import annotations

import sys
import types

import torch

ROUTING_MODULE = "routetool_test_moe_routing"
TARGET = f"{ROUTING_MODULE}:fused_musespark1x_routing"
ROUTE_SCALE = 2.5
EPS = 1e-20


@torch.library.custom_op("routetool_test::tiled_routing", mutates_args=(),
                         schema="(Tensor gating_output, Tensor bias, int topk, float route_scale, "
                                "Tensor? is_padding) -> (Tensor, Tensor)")
def _tiled_routing(gating_output, bias, topk, route_scale, is_padding):
    import routetool_kernels

    return routetool_kernels.variant("tiled")(gating_output, bias, topk, route_scale, None, "sigmoid", EPS,
                                   is_padding=is_padding)


@_tiled_routing.register_fake
def _(gating_output, bias, topk, route_scale, is_padding):
    n = gating_output.shape[0]
    return (gating_output.new_empty((n, topk), dtype=torch.float32),
            gating_output.new_empty((n, topk), dtype=torch.int32))


def fused_musespark1x_routing(gating_output, bias, topk, route_scale, router_output_multiplier=None,
                              router_score_normalization="sigmoid", router_score_division_eps=None,
                              topk_weights=None, topk_ids=None, *, is_padding=None):
    """The seed's signature around the tiled kernel (sigmoid scores, eps 1e-20, no multiplier)."""
    assert router_output_multiplier is None and router_score_normalization == "sigmoid"
    assert router_score_division_eps == EPS
    return torch.ops.routetool_test.tiled_routing(gating_output, bias, topk, route_scale, is_padding)


def routing_module() -> types.ModuleType:
    """The module the model calls the routing function through (registered in ``sys.modules``)."""
    mod = sys.modules.get(ROUTING_MODULE)
    if mod is None:
        mod = types.ModuleType(ROUTING_MODULE)
        mod.fused_musespark1x_routing = fused_musespark1x_routing
        sys.modules[ROUTING_MODULE] = mod
    return mod


class TinyMoEDecoder(torch.nn.Module):
    """``num_layers`` MoE layers: router logits (bf16), MuseSpark1x routing, and a residual
    update from the picked experts' vectors weighted by the routing weights, so that each
    layer's logits depend on the routing before it.

    ``forward(x [T, hidden], is_padding [T] bool)`` returns ``(h, logits, weights, ids)``:
    the last hidden state and, stacked over layers, what the model routed:
    ``[L, T, E]`` bf16, ``[L, T, K]`` float32, ``[L, T, K]`` int32.
    """

    def __init__(self, num_layers: int = 4, hidden: int = 64, num_experts: int = 96, topk: int = 6,
                 device: str | torch.device = "cpu", seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.topk = topk
        self.routing = routing_module()
        self.router = torch.nn.Parameter(torch.randn(num_layers, hidden, num_experts, generator=g) * 0.3)
        self.bias = torch.nn.Parameter(torch.randn(num_layers, num_experts, generator=g) * 0.05)
        self.experts = torch.nn.Parameter(torch.randn(num_layers, num_experts, hidden, generator=g))
        self.to(device)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor, is_padding: torch.Tensor):
        h = x
        logits, weights, ids = [], [], []
        for layer in range(self.router.shape[0]):
            g = (h @ self.router[layer]).to(torch.bfloat16)
            w, i = self.routing.fused_musespark1x_routing(g, self.bias[layer], self.topk, ROUTE_SCALE, None,
                                                          "sigmoid", EPS, is_padding=is_padding)
            picked = self.experts[layer][i.clamp(min=0).long()]  # [T, K, hidden]; padded rows weigh 0
            h = h + torch.tanh((w.unsqueeze(-1) * picked).sum(1))
            logits.append(g)
            weights.append(w)
            ids.append(i)
        return h, torch.stack(logits), torch.stack(weights), torch.stack(ids)


def batch(rows: int, padded: int, hidden: int, device, generator: torch.Generator):
    """Inputs of one step: ``rows`` token rows, the last ``padded`` of them padding."""
    x = torch.randn(rows, hidden, generator=generator).to(device)
    pad = torch.zeros(rows, dtype=torch.bool)
    if padded:
        pad[-padded:] = True
    return x, pad.to(device)


def assert_trace_holds(trace_path, routed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]):
    """The trace holds exactly the routed steps: per layer and step, the logits, the padding, the
    ids and weights (bit for bit). ``routed``: per step ``(logits, weights, ids, is_padding)`` as
    the model returned them (stacked over layers)."""
    from routetool.io.trace import open_trace

    with open_trace(trace_path) as t:
        num_layers = routed[0][0].shape[0]
        assert t.layers == tuple(range(num_layers))
        assert t.meta.router.route_scale == ROUTE_SCALE and t.meta.router.router_score_division_eps == EPS
        for layer in t.layers:
            steps = list(t.steps(layer))
            assert [s.num_tokens for s in steps] == [int(r[0].shape[1]) for r in routed]
            for s, (logits, weights, ids, pad) in zip(steps, routed):
                assert torch.equal(s.gating_output, logits[layer].cpu())
                assert torch.equal(s.recorded_weights, weights[layer].cpu())
                assert torch.equal(s.recorded_ids.to(torch.int32), ids[layer].cpu())
                got_pad = s.is_padding if s.is_padding is not None else torch.zeros(s.num_tokens, dtype=torch.bool)
                assert torch.equal(got_pad, pad.cpu())
