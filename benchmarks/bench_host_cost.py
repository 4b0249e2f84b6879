"""Host cost per call of the routing launchers, against an empty Triton launch measured in the same run.

Usage (GPU machine, repository root):
    python benchmarks/bench_host_cost.py [--tokens 1,64,4096,65536] [--experts 256] [--dtype fp32,bf16]
        [--variant tiled,seed] [--label after] [--csv PATH]

Per point (tokens x experts x dtype, topk 8) and variant, as ``routetool bench`` measures it
(``routetool.analysis.bench.host_latencies``: back-to-back eager calls, p10/p50/p90 over 20 samples of
100 calls, one synchronisation after each sample, outside the timed region; inputs rotated over
the bench's input sets, arguments by keyword, PDL left to the launcher's default):

* ``buffers``: caller-provided output buffers (what an engine's eager path does);
* ``buffers, pdl off`` (tiled, fp32): the same with ``use_pdl=False``;
* ``alloc``: the launcher allocates the outputs;
* ``graph``: the GPU latency of the same call under CUDA-graph replay (``--no-graph`` skips it).

Each row's floor is an empty ``@triton.jit`` kernel launched the ordinary way
(``kernel[(1,)](buffer)``, the JIT's dispatch), its batches timed in turn with the row's (the
host's speed drifts within a run); it is also measured alone first and last. Besides:
``torch.topk`` on the same logits and, with a ``kernel`` package that has ``routetool_kernels._dispatch``
(the signature plans), the empty kernel launched directly (``KernelLaunch.direct``: the
compiled kernel's own launch, without the JIT's dispatch), and whether the variant's calls took
the direct launch. The script imports only ``kernel`` and ``routetool.analysis.bench``, so the same
script times another checkout's kernels: put that checkout's ``kernel`` first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib
import sys

import torch
import triton

from routetool.analysis.bench import (DTYPES, BenchKernel, empty_kernel, empty_launch_call, host_latencies, host_latency,
                             input_sets, rotating_call)
from routetool.engine.timing import cuda_graph_latency

TARGET = 1.5
"""The issue's target: a routing call's host cost at most this many times an empty Triton launch's."""


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _direct_empty_launch():
    """A closure launching the empty kernel through ``routetool_kernels._dispatch.KernelLaunch.direct``, or None."""
    try:
        from routetool_kernels._dispatch import KernelLaunch, _Driver
    except ImportError:
        return None
    buf = torch.zeros(1, dtype=torch.int32, device="cuda")
    launch = KernelLaunch(empty_kernel(), (1,), (None,), {}, ("x_ptr",))
    launch.first(buf)
    if not launch.can_direct:
        return None
    stream = _Driver.current_stream(torch.cuda.current_device())
    ptr = buf.data_ptr()
    return lambda: launch.direct(stream, ptr)


def _took_direct_launch(variant: str) -> str:
    """'yes' / 'no' for the variant's plans (all of them direct), 'n/a' for a kernel package without plans."""
    module = importlib.import_module("routetool_kernels.routing" if variant == "tiled" else "routetool_kernels.seed")
    plans = getattr(module, "_PLANS", None)
    if plans is None:
        return "n/a"
    launches = [p.launch for p in plans._plans.values() if p.launch is not None]
    return "yes" if launches and all(x.can_direct for x in launches) else "no"


def main() -> int:
    import routetool_kernels

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,64,4096,65536")
    ap.add_argument("--experts", default="256")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--dtype", default="fp32,bf16")
    ap.add_argument("--variant", default="tiled,seed")
    ap.add_argument("--label", default="", help="names this run in the output (e.g. before / after)")
    ap.add_argument("--csv", default=None, help="write the rows as CSV")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph latency")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_host_cost.py needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    head = dict(label=a.label, gpu=props.name, torch=torch.__version__, triton=triton.__version__,
                kernel_package=routetool_kernels.__file__)
    print(" ".join(f"{k}={v}" for k, v in head.items()), flush=True)

    rows = []
    empty = empty_launch_call()

    def add(what, fn, variant="", dtype="", tokens=0, experts=0, graph=None, direct=""):
        host, floor = host_latencies([fn, empty])
        rows.append(dict(head, what=what, variant=variant, dtype=dtype, num_tokens=tokens, num_experts=experts,
                         host_us_p10=host.p10_us, host_us_p50=host.p50_us, host_us_p90=host.p90_us,
                         empty_launch_host_us_p50=floor.p50_us, host_over_empty_launch=host.p50_us / floor.p50_us,
                         graph_latency_us_p50=graph.p50_us if graph else None, direct_launch=direct))

    first_floor = host_latency(empty)
    direct_empty = _direct_empty_launch()
    if direct_empty is not None:
        add("empty launch (direct)", direct_empty)
    E0 = _int_list(a.experts)[0]
    xs = [s.gating_output for s in input_sets(64, E0, a.topk, torch.float32, l2, seed=1)]
    state = {"i": 0}

    def topk_call():
        state["i"] += 1
        torch.topk(xs[state["i"] % len(xs)], a.topk)

    add("torch.topk", topk_call, dtype="fp32", tokens=64, experts=E0)

    for variant in a.variant.split(","):
        fn = routetool_kernels.variant(variant)
        for dname in a.dtype.split(","):
            if variant == "seed" and dname != "fp32":
                continue  # the seed rejects half-precision logits
            for E in _int_list(a.experts):
                for T in _int_list(a.tokens):
                    sets = input_sets(T, E, a.topk, DTYPES[dname], l2, seed=T * 7919 + E)
                    call = rotating_call(BenchKernel(variant, fn), sets)
                    call()  # (compiles)
                    graph = None if a.no_graph else cuda_graph_latency(call, rep_ms=10)
                    add("buffers", call, variant, dname, T, E, graph, _took_direct_launch(variant))
                    if variant == "tiled" and dname == "fp32":
                        add("buffers, pdl off", rotating_call(BenchKernel(variant, fn, pdl=False), sets), variant,
                            dname, T, E)
                    bare = [dataclasses.replace(s, topk_weights=None, topk_ids=None) for s in sets]
                    add("alloc", rotating_call(BenchKernel(variant, fn), bare), variant, dname, T, E)
                    del sets, bare
                    print(f"  {variant} {dname} T={T} E={E} done", file=sys.stderr, flush=True)
    last_floor = host_latency(empty)

    print(f"{'what':<18} {'variant':<7} {'dtype':<5} {'tokens':>7} {'E':>4} {'host p50':>9} {'p10-p90':>13} "
          f"{'floor':>6} {'x floor':>8} {'graph p50':>10} direct")
    for r in rows:
        r["meets_target"] = r["host_over_empty_launch"] <= TARGET if r["what"] == "buffers" else ""
        graph = f"{r['graph_latency_us_p50']:.2f}" if r["graph_latency_us_p50"] is not None else "-"
        print(f"{r['what']:<18} {r['variant']:<7} {r['dtype']:<5} {r['num_tokens'] or '':>7} {r['num_experts'] or '':>4} "
              f"{r['host_us_p50']:>9.2f} {r['host_us_p10']:>6.2f}-{r['host_us_p90']:<6.2f} "
              f"{r['empty_launch_host_us_p50']:>6.2f} {r['host_over_empty_launch']:>7.2f}x {graph:>10} "
              f"{r['direct_launch']}")
    met = [r for r in rows if r["what"] == "buffers"]
    print(f"empty Triton launch alone: {first_floor.p50_us:.2f} us per call first, {last_floor.p50_us:.2f} last; "
          f"target: a call with caller buffers at most {TARGET}x the empty launch timed in turn with it: "
          f"{sum(bool(r['meets_target']) for r in met)} of {len(met)} points")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
