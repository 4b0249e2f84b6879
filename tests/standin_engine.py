"""A stand-in for a vLLM-like engine, for testing routetool's vLLM plugin without vLLM.

What it imitates of vLLM (and what the plugin relies on):

* each worker process loads the ``vllm.general_plugins`` entry points through
  ``importlib.metadata`` and calls them, before the model is built (vLLM's
  ``load_general_plugins``);
* then it joins the process group (gloo here) and sets up its parallel state: a module
  ``vllm.distributed.parallel_state`` whose ``_WORLD``, ``_TP``, ``_DP``, ``_PP`` and ``_EP``
  group coordinators carry ``rank``, ``rank_in_group`` and ``world_size`` (the fields
  :mod:`routetool.capture.ranks` reads; the DP x TP layout of vLLM, the EP group spanning both);
* the model's MoE layers call the routing function through its module at call time; a
  profile run (dummy tokens) comes before the first real step; every step goes through
  ``Runner.execute_model`` (the plugin's step hook in the tests).

The DP ranks route different tokens; the TP ranks of one DP rank route the same ones.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import types

import torch

from kernel.reference import musespark1x_routing_reference

E, K, HIDDEN = 24, 4, 16  # non-power-of-2 experts, as real MoE configs (e.g. 384) often are
LAYER_IDS = (1, 2, 3)
ROUTE_SCALE = 2.5


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


class _Group:
    """The fields of vLLM's GroupCoordinator that routetool reads."""

    def __init__(self, rank: int, ranks: list[int]):
        self.rank = rank
        self.ranks = ranks
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(rank)
        self.local_rank = rank


def install_parallel_state(rank: int, world: int, tp: int) -> None:
    """A ``vllm.distributed.parallel_state`` for a DP x TP layout (EP over all ranks)."""
    mod = types.ModuleType("vllm.distributed.parallel_state")
    dp = world // tp
    mod._WORLD = _Group(rank, list(range(world)))
    mod._TP = _Group(rank, [rank // tp * tp + i for i in range(tp)])
    mod._DP = _Group(rank, [rank % tp + i * tp for i in range(dp)])
    mod._PP = _Group(rank, [rank])
    mod._EP = _Group(rank, list(range(world)))
    sys.modules[mod.__name__] = mod


class Runner:
    """A model of ``len(LAYER_IDS)`` MoE layers; ``routed`` keeps what every real step routed."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.router = [torch.randn(HIDDEN, E, generator=g) for _ in LAYER_IDS]
        self.bias = [torch.randn(E, generator=g) * 0.05 for _ in LAYER_IDS]
        self.module = importlib.import_module(__name__)
        self.routed: list[list[tuple]] = []

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> list[tuple]:
        calls = []
        for layer in range(len(LAYER_IDS)):
            logits = (x @ self.router[layer]).to(torch.bfloat16)
            w, ids = self.module.fused_musespark1x_routing(logits, self.bias[layer], K, ROUTE_SCALE, None, "sigmoid",
                                                           1e-20, is_padding=pad)
            calls.append((logits, pad, w, ids))
            x = x + torch.tanh(w.sum(-1, keepdim=True))
        return calls

    def profile_run(self, num_tokens: int = 32) -> None:
        """The engine's warm-up: dummy tokens, not a step of the workload."""
        self.forward(torch.zeros(num_tokens, HIDDEN), torch.zeros(num_tokens, dtype=torch.bool))

    def execute_model(self, x: torch.Tensor, pad: torch.Tensor) -> None:
        self.routed.append(self.forward(x, pad))


STEPS = [(7, 0), (3, 1), (4, 0), (9, 2)]  # (rows, padded rows) of each real step


def worker(rank: int, world: int, tp: int, site: str, init_file: str, results: str) -> None:
    """One engine worker process (``torch.multiprocessing.spawn`` target)."""
    sys.path.insert(0, site)  # where the test put the plugin's entry point
    for entry in importlib.metadata.entry_points(group="vllm.general_plugins"):
        entry.load()()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    install_parallel_state(rank, world, tp)
    dp_rank = rank // tp
    runner = Runner(seed=0)
    runner.profile_run()
    gen = torch.Generator().manual_seed(100 + dp_rank)
    for rows, padded in STEPS:
        x = torch.randn(rows, HIDDEN, generator=gen)
        pad = torch.zeros(rows, dtype=torch.bool)
        if padded:
            pad[-padded:] = True
        runner.execute_model(x, pad)
    torch.save(runner.routed, f"{results}/rank-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
