"""Drive a stand-in of vLLM 0.33 (tests/fixtures/vllm033: its module layout and import order,
routetool's own small code) as vLLM drives a GPU worker, for testing routetool's vLLM plugin
without vLLM.

:func:`worker` is one worker process: it puts the fixture first on ``sys.path`` and the
plugin's entry point on it, then runs vLLM's order: the worker loads the ``vllm.general_plugins``
(the plugin starts; no model module is loaded yet), sets up the parallel state (DP x TP, EP
over all ranks), makes the model runner (V2 unless ``VLLM_USE_V2_MODEL_RUNNER=0``), loads the
model (importing ``vllm.models.muse_spark``, whose ``__init__`` imports ``nvidia/model.py``, which
imports ``common/moe.py``: both from-import the routing function), runs the profile run, then
the scheduled steps. The DP ranks route different tokens; the TP ranks of one DP rank the same.

It also keeps :func:`fused_musespark1x_routing` (a routing function with the seed's signature,
computed by the one reference) for the recorder's own tests.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from routetool_kernels.reference import musespark1x_routing_reference

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "vllm033"
"""The folder holding the stand-in ``vllm`` package."""
E, K = 24, 4  # non-power-of-2 experts, as real MoE configs (e.g. 384) often are
LAYER_IDS = (1, 2, 3)  # the fixture model's MoE layers (layer 0 is dense; layer 2 runs the MegaMoE path)
HIDDEN = 16
STEPS = [(7, 0), (3, 1), (4, 0), (9, 2)]  # (rows, padded rows) of each real step


def fused_musespark1x_routing(gating_output, bias, topk, route_scale, router_output_multiplier=None,
                              router_score_normalization="sigmoid", router_score_division_eps=None,
                              topk_weights=None, topk_ids=None, *, is_padding=None):
    """A routing function with the seed's signature: the one reference, written into the
    caller's buffers when given (as the seed does)."""
    w, ids = musespark1x_routing_reference(gating_output, bias, topk, route_scale, router_output_multiplier,
                                           router_score_normalization, router_score_division_eps,
                                           is_padding=is_padding)
    n = gating_output.shape[0]
    if topk_weights is None:
        topk_weights = torch.empty((n, topk), dtype=torch.float32)
    if topk_ids is None:
        topk_ids = torch.empty((n, topk), dtype=torch.int32)
    topk_weights[:n, :topk] = w
    topk_ids[:n, :topk] = ids.to(torch.int32)
    return topk_weights[:n, :topk], topk_ids[:n, :topk]


def use_fixture(site: str | None = None) -> None:
    """Put the stand-in ``vllm`` (and ``site``, a folder holding the plugin's entry point) first
    on ``sys.path``."""
    for folder in (site, str(FIXTURE)):
        if folder is not None and folder not in sys.path:
            sys.path.insert(0, folder)


def run_worker(rank: int, world: int, tp: int, steps=STEPS, model_first: bool = False) -> list[list[tuple]]:
    """One worker in vLLM's order (module docstring); returns what every real step routed:
    per step, per MoE layer, ``(logits, is_padding, topk_weights, topk_ids)``.
    ``model_first``: import the model package before the plugins load (another order)."""
    if model_first:
        import vllm.models.muse_spark  # noqa: F401
    from vllm.v1.worker.gpu_worker import Worker

    worker = Worker(rank, world, tp)  # loads the plugins
    if not model_first:
        assert not any(name.startswith("vllm.models") for name in sys.modules), "the model was imported early"
    worker.init_device()
    worker.load_model()
    worker.determine_available_memory()  # the profile run (dummy tokens): not a step of the workload
    gen = torch.Generator().manual_seed(100 + rank // tp)
    for rows, padded in steps:
        x = torch.randn(rows, HIDDEN, generator=gen)
        pad = torch.zeros(rows, dtype=torch.bool)
        if padded:
            pad[-padded:] = True
        worker.execute_model(SimpleNamespace(hidden_states=x, is_padding=pad))
    return worker.model_runner.model.routed


def worker(rank: int, world: int, tp: int, site: str, init_file: str, results: str) -> None:
    """One engine worker process (``torch.multiprocessing.spawn`` target); saves what it routed
    to ``<results>/rank-<rank>.pt``."""
    use_fixture(site)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    routed = run_worker(rank, world, tp)
    torch.save(routed, f"{results}/rank-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def forked_worker(site: str, results: str) -> None:
    """vLLM's default start method: the engine core loads the plugins, then forks a worker
    (``VLLM_WORKER_MULTIPROC_METHOD=fork``) whose own ``load_general_plugins`` does nothing.
    Run it in a fresh interpreter (a process that already ran torch's thread pool may hang in
    a forked child); saves what the worker routed to ``results``."""
    import multiprocessing

    use_fixture(site)
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the engine core
    child = multiprocessing.get_context("fork").Process(target=_save_routed, args=(results,))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"the forked worker exited with {child.exitcode}")


def _save_routed(results: str) -> None:
    torch.save(run_worker(0, 1, 1), results)
