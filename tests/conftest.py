"""Test set-up: choose compiled (CUDA) or interpreted (CPU) Triton before any kernel import; the
fixtures that build traces, sharded traces and files around the trace writer."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton reads this when a kernel is defined; kernel modules are imported later, lazily.
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")

# the trace fixtures' imports, after TRITON_INTERPRET is set (routetool.io loads no Triton code today)
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from routetool.io.sharded import shard_path, write_index  # noqa: E402
from routetool.io.trace import LayerArrays, RouterConfig, TraceMeta, metadata_dict, write_trace  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine; see README)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


# -- trace builders ------------------------------------------------------------------------------
# Every test that needs a trace file, a sharded trace or a trace rewritten around the writer asks
# for one of these factories; a relative path is taken under the test's ``tmp_path``.

TEST_ROUTER = RouterConfig(num_experts=8, topk=2, route_scale=1.0)
"""The router of a test trace that names none: 8 experts, top-2, sigmoid, route_scale 1."""


@pytest.fixture
def make_trace(tmp_path):
    """``make_trace(path, layers, router=None, **meta) -> Path``: a trace v1 file written by routetool's
    writer (``write_trace``, replacing an existing file) at ``path`` (under ``tmp_path`` when relative;
    its folder must exist), ``layers`` a dict layer -> ``LayerArrays``,
    ``router`` :data:`TEST_ROUTER` unless given; ``model`` and ``provenance`` default to "test" and
    "made by a test", other keywords go to the metadata as they are (e.g. ``rank="1"``).

    Raises what ``write_trace`` raises (``RouteToolError``: a missing folder, arrays off the schema)."""
    def make(path, layers: dict[int, LayerArrays], router: RouterConfig | None = None, **meta) -> Path:
        trace_meta = TraceMeta(model=meta.pop("model", "test"), router=router or TEST_ROUTER,
                               provenance=meta.pop("provenance", "made by a test"), extra=meta)
        return write_trace(tmp_path / path, trace_meta, layers, force=True)
    return make


@pytest.fixture
def make_sharded(tmp_path, make_trace):
    """``make_sharded(index, shards, router=None, shard_meta=None, complete=True, stopped_by="exit", **meta)
    -> Path``: a sharded trace as the recorder writes it, shard ``i`` (a dict layer -> ``LayerArrays``)
    in ``shard_path(index, i)``, then the index listing each shard's name and ``size_bytes``.
    ``router`` is every shard's, or a list of one per shard; ``shard_meta`` (one dict per shard) and
    ``meta`` (every shard) go to the shards' metadata."""
    def make(index, shards: list[dict[int, LayerArrays]], router: RouterConfig | list[RouterConfig] | None = None,
             shard_meta: list[dict] | None = None, complete: bool = True, stopped_by: str | None = "exit",
             **meta) -> Path:
        index = tmp_path / index
        routers = router if isinstance(router, list) else [router] * len(shards)
        entries = []
        for i, layers in enumerate(shards):
            p = make_trace(shard_path(index, i), layers, routers[i], **meta, **(shard_meta[i] if shard_meta else {}))
            entries.append({"path": p.name, "size_bytes": p.stat().st_size})
        return write_index(index, entries, complete=complete, stopped_by=stopped_by)
    return make


@pytest.fixture
def raw_trace(tmp_path):
    """``raw_trace(path, tensors, router=None, **meta) -> Path``: a file written around routetool's
    writer (safetensors' ``save_file``): the tensor names and values exactly as given, unchecked, under
    the metadata of a trace of ``router`` (:data:`TEST_ROUTER` unless given, model "m", provenance "p"),
    each keyword replacing one metadata value (a string), ``None`` leaving that key out. For input that
    routetool's reader must refuse."""
    def make(path, tensors: dict[str, torch.Tensor], router: RouterConfig | None = None, **meta) -> Path:
        path = tmp_path / path
        raw = metadata_dict(TraceMeta(model="m", router=router or TEST_ROUTER, provenance="p"), 1)
        raw.update(meta)
        save_file(tensors, str(path), metadata={k: v for k, v in raw.items() if v is not None})
        return path
    return make


@pytest.fixture
def copy_trace(tmp_path):
    """``copy_trace(src, dst, keep=None, drop=(), **meta) -> Path``: the safetensors file ``src`` written
    again to ``dst`` (its folders made), holding the tensors whose name ``keep(name)`` accepts (all
    without ``keep``), its metadata without the keys in ``drop`` and with ``meta``'s values (strings)
    set. Written around routetool's writer: nothing is checked."""
    def copy(src, dst, keep: Callable[[str], bool] | None = None, drop: tuple[str, ...] = (), **meta) -> Path:
        dst = tmp_path / dst
        with safe_open(str(src), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys() if keep is None or keep(k)}
            raw = {k: v for k, v in f.metadata().items() if k not in drop}
        dst.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(dst), metadata={**raw, **meta})
        return dst
    return copy
