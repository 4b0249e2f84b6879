"""MuseSpark1x top-k routing: Triton kernels and the PyTorch reference that defines them.

Depends on torch and triton only. Triton reads ``TRITON_INTERPRET`` when a kernel is
defined, so the Triton modules (:mod:`routetool_kernels.routing` with :mod:`routetool_kernels.routing_jit`,
:mod:`routetool_kernels.seed`) are imported lazily, on first use of their names here;
:mod:`routetool_kernels.reference` and the launch settings (:mod:`routetool_kernels.routing_policy`) need no Triton,
and are imported on first use too, so that :mod:`routetool_kernels.spec` (:class:`~routetool_kernels.spec.RouterSpec`,
standard library only) imports neither torch nor Triton.

Variants (all with the seed's signature, returning ``(topk_weights, topk_ids)``):

* ``tiled`` (:func:`fused_musespark1x_routing`, the default): integer selection keys, any
  float gating dtype; the scan algorithm for decode batches, and for prefill batches the rows
  algorithm (sigmoid, ``topk`` <= 8, <= 256 experts) or the two-level one (:func:`default_config`).
* ``seed`` (:func:`fused_musespark1x_routing_seed`): the seed's algorithm, one program per
  token with repeated ``tl.argmax``; float32 gating_output only.

Both launchers check a call's arguments and pick its launch settings once per argument
signature and then launch the compiled kernel directly (:mod:`routetool_kernels._dispatch`), so a call
costs the host little more than an empty Triton launch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "musespark1x_routing_reference": "routetool_kernels.reference",
    "fused_musespark1x_routing": "routetool_kernels.routing",
    "LaunchConfig": "routetool_kernels.routing_policy",
    "default_config": "routetool_kernels.routing_policy",
    "fused_musespark1x_routing_seed": "routetool_kernels.seed",
}

VARIANT_NAMES = ("tiled", "seed")
"""Names of the project's kernel variants, default first."""


def variant(name: str):
    """The launcher of variant ``name`` (see :data:`VARIANT_NAMES`). Raises KeyError."""
    if name == "tiled":
        return importlib.import_module("routetool_kernels.routing").fused_musespark1x_routing
    if name == "seed":
        return importlib.import_module("routetool_kernels.seed").fused_musespark1x_routing_seed
    raise KeyError(name)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kernel' has no attribute {name!r}")


__all__ = [
    "VARIANT_NAMES",
    "LaunchConfig",
    "default_config",
    "fused_musespark1x_routing",
    "fused_musespark1x_routing_seed",
    "musespark1x_routing_reference",
    "variant",
]
