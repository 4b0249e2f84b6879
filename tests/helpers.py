"""Shared test helpers: routing invariant checks and the CLI's parameters (no second reference); the
trace builders are fixtures, in conftest.py."""

from __future__ import annotations

import torch


def assert_routing_invariants(weights, ids, num_experts, topk, route_scale, is_padding=None, eps=None):
    """ids in range and distinct on unpadded rows, -1/0 on padded rows, weights finite, >= 0,
    and (without eps) summing to route_scale unless every picked score was 0."""
    assert ids.shape == weights.shape == (ids.shape[0], topk)
    assert weights.dtype == torch.float32
    pad = is_padding if is_padding is not None else torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    ids = ids.long()
    assert torch.isfinite(weights).all()
    assert (weights >= 0).all()
    real = ~pad
    assert ((ids[real] >= 0) & (ids[real] < num_experts)).all()
    s = ids[real].sort(-1).values
    assert (s[:, 1:] != s[:, :-1]).all(), "duplicate expert id in a row"
    assert (ids[pad] == -1).all() and (weights[pad] == 0).all()
    if eps is None and real.any():
        sums = weights[real].sum(-1)
        ok = torch.isclose(sums, torch.full_like(sums, route_scale), rtol=1e-5, atol=1e-6) | (sums == 0)
        assert ok.all(), f"weight sums {sums[~ok][:5].tolist()} != route_scale {route_scale}"


def command_params(command, keep, path="routetool"):
    """``(command path, parameter)`` for every parameter of ``command`` and its subcommands for which
    ``keep(parameter)`` is true, e.g. ``command_params(routetool.cli.main, lambda p: p.name == "json_path")``."""
    found = [(path, param) for param in command.params if keep(param)]
    for name, sub in getattr(command, "commands", {}).items():
        found += command_params(sub, keep, f"{path} {name}")
    return found
