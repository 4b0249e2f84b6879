"""GPU latency under CUDA-graph replay (``triton.testing.do_bench_cudagraph``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Latency:
    """Latency quantiles of one call, in microseconds.

    Each sample is the mean time per call over one replay of a CUDA graph that holds
    many back-to-back calls; p10/p50/p90 are over the replays.
    """

    p10_us: float
    p50_us: float
    p90_us: float


def cuda_graph_latency(fn: Callable[[], object], rep_ms: float = 20.0) -> Latency:
    """Time ``fn`` (which must be CUDA-graph capturable) by graph replay.

    Inputs and outputs must be allocated before the call: the timed region holds only
    what ``fn`` launches. Uses ``triton.testing.do_bench_cudagraph`` (warm-up, then a
    graph of about ``rep_ms`` of calls, replayed 10 times).

    Raises:
        RuntimeError: from CUDA, e.g. when ``fn`` is not capturable.
    """
    import triton.testing

    q = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, quantiles=[0.1, 0.5, 0.9])
    return Latency(p10_us=q[0] * 1e3, p50_us=q[1] * 1e3, p90_us=q[2] * 1e3)


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
