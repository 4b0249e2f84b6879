"""Throughput of `routetool balance`'s analysis on a synthetic streamed trace.

Builds (outside the timed region) an ids-only trace of L layers x T tokens x E experts with
skewed routing (top-K of per-expert offsets plus Gumbel noise; the expert permutation
differs per layer), split into steps of S tokens, then times the whole analysis as the CLI
runs it (streaming the trace step by step from disk: expert histograms, EP ranks for
every --ep-size with per-step balancedness and tokens received, capacity for three
factors, windows, prefill/decode, EPLB what-if with one redundant expert per GPU), on the
CPU or a CUDA GPU. Reports token-layers per second (p50, with p10/p90 over --repeats),
the peak anonymous memory during the analysis (what the process allocates, without the
trace's memory-mapped pages) against the trace size, and the versions. The first pass over
a trace larger than the page cache reads from disk; later passes may not.

    python benchmarks/bench_balance.py --device cpu --layers 8 --tokens 262144
    python benchmarks/bench_balance.py --device cuda --layers 60 --tokens 1000000 --out $OUT/bench_balance_cuda.json

``--routing reference`` adds bf16 logits and routes them with the PyTorch reference, with
the bias effect (a second routing with the bias zeroed): the cost of routing from logits.
Keep T x L small with it (the logits are E times larger than the ids).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from routetool.analysis.balance import BalanceOptions, EplbOptions, TraceSource, analyze_balance, route_fn_from  # noqa: E402
from routetool.io.trace import LayerArrays, RouterConfig, Trace, TraceMeta, write_trace  # noqa: E402


def _base_ids(tokens: int, experts: int, topk: int, skew: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    offsets = -skew * torch.log(torch.arange(1, experts + 1, dtype=torch.float32))  # Zipf-like popularity
    out = torch.empty(tokens, topk, dtype=torch.int32)
    chunk = 65536
    for a in range(0, tokens, chunk):
        n = min(chunk, tokens - a)
        u = torch.rand(n, experts, generator=g).clamp_(1e-9, 1 - 1e-9)
        out[a:a + n] = torch.topk(offsets - torch.log(-torch.log(u)), topk, dim=1).indices.to(torch.int32)
    return out


def build_trace(path: Path, layers: int, tokens: int, experts: int, topk: int, step_tokens: int, skew: float,
                logits: bool, seed: int) -> None:
    base = _base_ids(tokens, experts, topk, skew, seed)
    offsets = torch.arange(0, tokens, step_tokens, dtype=torch.int64).tolist() + [tokens]
    g = torch.Generator().manual_seed(seed + 1)
    arrays = {}
    for layer in range(layers):
        perm = torch.randperm(experts, generator=g).to(torch.int32)
        ids = perm[base.long()].roll(layer * 997, dims=0)
        gating = None
        if logits:
            gating = torch.randn(tokens, experts, generator=g).to(torch.bfloat16)
            gating += (0.5 * torch.log(torch.arange(1, experts + 1, dtype=torch.float32)))[perm.long()].neg().to(torch.bfloat16)
        arrays[layer] = LayerArrays(topk_ids=ids, gating_output=gating,
                                    bias=(0.01 * torch.randn(experts, generator=g)) if logits else None,
                                    step_offsets=torch.tensor(offsets, dtype=torch.int64))
    meta = TraceMeta(model="bench_balance synthetic", router=RouterConfig(num_experts=experts, topk=topk, route_scale=1.0),
                     provenance=f"benchmarks/bench_balance.py seed={seed} skew={skew}")
    write_trace(path, meta, arrays, force=True)


class AnonRssSampler:
    """Peak anonymous resident memory (``RssAnon`` of /proc/self/status, Linux) while running:
    memory the process allocated, without the trace's memory-mapped file pages."""

    def __init__(self, period_s: float = 0.02):
        self.period_s, self.peak, self._stop = period_s, None, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def read() -> int | None:
        try:
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith("RssAnon:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            v = self.read()
            if v is not None:
                self.peak = v if self.peak is None else max(self.peak, v)
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=262144, help="tokens per layer")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--step-tokens", type=int, default=8192, help="tokens per captured step")
    ap.add_argument("--ep-sizes", default="8,32")
    ap.add_argument("--skew", type=float, default=0.6, help="Zipf exponent of expert popularity")
    ap.add_argument("--routing", choices=("recorded", "reference"), default="recorded")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trace", type=Path, default=None, help="keep the synthetic trace here (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    args = ap.parse_args()

    if args.out is not None and args.out.exists() and not args.force:
        print(f"bench_balance: {args.out} already exists (pass --force to replace it)", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_balance: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    ep_sizes = [int(x) for x in args.ep_sizes.split(",")]

    tmp = None
    path = args.trace
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_balance.")
        path = Path(tmp.name) / "synthetic.safetensors"
    t0 = time.perf_counter()
    if not path.exists():
        build_trace(path, args.layers, args.tokens, args.experts, args.topk, args.step_tokens, args.skew,
                    args.routing == "reference", seed=0)
    build_s = time.perf_counter() - t0
    size = path.stat().st_size
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    route = None
    if args.routing == "reference":
        from routetool_kernels.reference import musespark1x_routing_reference

    times, result = [], None
    anon_before = AnonRssSampler.read()
    sampler = AnonRssSampler().__enter__()
    for _ in range(args.repeats):
        with Trace(path) as trace:
            if args.routing == "reference":
                route = route_fn_from(musespark1x_routing_reference, trace.meta.router)
                src = TraceSource(trace, trace.layers, routing="reference", route_fn=route, route_name="reference",
                                  nobias_fn=route)
            else:
                src = TraceSource(trace, trace.layers, routing="recorded", bias_effect=False)
            options = BalanceOptions(ep_sizes=ep_sizes, eplb=EplbOptions())
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            result = analyze_balance(src, options, device)  # synchronizes the GPU before returning
            times.append(time.perf_counter() - t)
    sampler.__exit__()
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    token_layers = result.rows
    rates = sorted(token_layers / t for t in times)
    q = statistics.quantiles(rates, n=10, method="inclusive") if len(rates) > 1 else [rates[0]] * 9
    doc = {
        "benchmark": "routetool balance analysis throughput",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "triton_version": _triton_version(),
        "python_version": platform.python_version(),
        "routing": args.routing,
        "layers": args.layers, "tokens_per_layer": args.tokens, "num_experts": args.experts, "topk": args.topk,
        "step_tokens": args.step_tokens, "steps_per_layer": -(-args.tokens // args.step_tokens), "ep_sizes": ep_sizes,
        "token_layers": token_layers,
        "trace_bytes": size,
        "build_s": build_s,
        "repeats_s": times,
        "throughput_token_layers_per_s": {"p10": q[0], "p50": statistics.median(rates), "p90": q[-1]},
        "peak_rss_bytes_before": rss_before,
        "peak_rss_bytes_after": rss_after,
        "anon_rss_bytes_before_analysis": anon_before,
        "peak_anon_rss_bytes_during_analysis": sampler.peak,
        "eplb_balancedness_mean": {"before": result.eplb.summary_before.mean, "after": result.eplb.summary_after.mean},
    }
    p50 = doc["throughput_token_layers_per_s"]["p50"]
    print(f"{token_layers:,} token-layers ({args.layers} layers x {args.tokens:,} tokens, E={args.experts}, "
          f"K={args.topk}, steps of {args.step_tokens}) on {doc['device_name']} ({device}):")
    print(f"  analysis p50 {p50:,.0f} token-layers/s (p10 {q[0]:,.0f}, p90 {q[-1]:,.0f}); "
          f"{statistics.median(times):.2f} s per pass; trace {size / 1e6:,.0f} MB; "
          f"peak RSS {rss_before / 1e6:,.0f} -> {rss_after / 1e6:,.0f} MB (with mapped trace pages)")
    if sampler.peak is not None:
        print(f"  anonymous memory (allocations, no mapped file pages): {anon_before / 1e6:,.0f} MB before, "
              f"peak {sampler.peak / 1e6:,.0f} MB during the analysis")
    print(f"  torch {torch.__version__}, triton {doc['triton_version']}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_out = tempfile.mkstemp(prefix=f".{args.out.name}.", dir=args.out.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, indent=2)
        os.replace(tmp_out, args.out)
        print(f"  wrote {args.out}")
    if tmp is not None:
        tmp.cleanup()
    return 0


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
