"""Overhead of recording a routing call with the recorder's device ring, under CUDA-graph replay.

Outside the timed region it builds ``--calls`` routing calls (the tiled kernel, ``--tokens`` x
``--experts`` logits in bf16, top-``--topk``, preallocated outputs and padding, as an engine's
decode graph has them) and captures them into CUDA graphs:

* ``plain``: the routing calls alone;
* ``recorded``: the same calls through a started :class:`RoutingRecorder`, so the record op's
  kernel follows each routing kernel in the graph (one per variant of the record kernel:
  rows per program, warps);
* ``record-only``: the record op alone on fixed inputs (the kernel's own time in a graph);
* ``paused``: the recorded graph while the recorder is paused (the launch decides to store
  nothing: the floor of a dropped step).

Each repetition replays each graph ``--replays`` times between two CUDA events (the graphs
interleaved, so that clock drift hits both); before each repetition the recorder is flushed
(untimed: the ring is empty, every replay stores its step). The overhead per call is
(recorded - plain) / calls. It prints p50 (p10, p90) over ``--repeats`` in ``latency_us`` with
the GPU, torch and triton versions, checks that nothing was dropped and that the trace holds every
replayed step, appends one long-format row per number to the results file (``--csv``, default
benchmarks/results.csv, through benchmarks/results.py) and writes them all to ``--json``.

    python benchmarks/bench_recorder.py            # the target: < 2 us a call at 64 x 256 bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))
import results  # noqa: E402 - benchmarks/results.py, the one results file
from routetool.capture.recorder import RoutingRecorder  # noqa: E402

MODULE = "routetool_bench_routing"


def _quantiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=10, method="inclusive")
    return {"p10": q[0], "p50": statistics.median(values), "p90": q[-1]}


def _time_graph(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Microseconds per replay of ``replays`` back-to-back replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / replays


def _capture(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--calls", type=int, default=8, help="routing calls (MoE layers) per graph")
    ap.add_argument("--replays", type=int, default=20, help="replays per timed repetition")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--eager-blocks", type=int, default=30, help="interleaved blocks of eager calls of each kind")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--csv", default=str(results.RESULTS), help="results file to append to ('' for none)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_recorder: needs a CUDA GPU", file=sys.stderr)
        return 2
    import routetool_kernels
    import triton

    T, E, K, L = args.tokens, args.experts, args.topk, args.calls
    mod = types.ModuleType(MODULE)
    mod.fused_musespark1x_routing = routetool_kernels.variant("tiled")
    sys.modules[MODULE] = mod
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = [torch.randn((T, E), device="cuda", generator=gen).to(torch.bfloat16) for _ in range(L)]
    bias = [torch.randn(E, device="cuda", generator=gen) * 0.05 for _ in range(L)]
    pad = torch.zeros(T, dtype=torch.bool, device="cuda")
    pad[-T // 8:] = True
    weights = [torch.empty((T, K), device="cuda") for _ in range(L)]
    ids = [torch.empty((T, K), dtype=torch.int32, device="cuda") for _ in range(L)]

    def route():
        for layer in range(L):
            mod.fused_musespark1x_routing(logits[layer], bias[layer], K, 2.5, None, "sigmoid", 1e-20,
                                          weights[layer], ids[layer], is_padding=pad)

    def record_only():
        for layer in range(L):
            torch.ops.routetool.record_routing(rec._token, logits[layer], bias[layer], pad, weights[layer],
                                               ids[layer], rec._handle, -1, K, 2.5, None, "sigmoid", 1e-20)

    plain = _capture(route)
    out_dir = Path(tempfile.mkdtemp(prefix="bench-recorder-"))
    steps_per_rep = args.replays * 3  # recorded, record-only and paused graphs store (or count) a step per replay
    rec = RoutingRecorder(out_dir / "trace.json", target=f"{MODULE}:fused_musespark1x_routing", num_layers=L,
                          ring_mb=max(64, 2 * steps_per_rep * L * T * (E * 2 + K * 8 + 1) / 2**20),
                          ring_steps=max(256, 2 * steps_per_rep), shard_mb=256, drain_interval_s=1e9)
    rec.start()
    route()  # the first call makes the ring
    ring = rec._ring
    # (rows per program: None = the default, warps, programmatic dependent launch: None = where supported)
    variants = [(None, 4, None), (None, 8, None), (16, 4, None), (None, 4, False)]
    graphs = {}
    for rows_per_program, warps, pdl in variants:
        ring.rows_per_program, ring.num_warps, ring.use_pdl = rows_per_program, warps, pdl
        graphs[(rows_per_program, warps, pdl)] = _capture(route)
    ring.rows_per_program, ring.num_warps, ring.use_pdl = None, 4, None
    only = _capture(record_only)
    rec.flush()

    times: dict[str, list[float]] = {"plain": [], "record-only": [], "paused": []}
    def label(key):
        return f"recorded rows/program={key[0] or 'default'} warps={key[1]}" + (" no PDL" if key[2] is False else "")

    for key in graphs:
        times[label(key)] = []
    steps_replayed = 0
    for _ in range(args.repeats):
        rec.flush()
        times["plain"].append(_time_graph(plain, args.replays))
        for key, graph in graphs.items():
            times[label(key)].append(_time_graph(graph, args.replays))
            steps_replayed += args.replays
            rec.flush()
        times["record-only"].append(_time_graph(only, args.replays))
        steps_replayed += args.replays
        rec.flush()
        rec.pause()
        times["paused"].append(_time_graph(graphs[variants[0]], args.replays))
        rec.resume()
    # the host side of a routing call run eagerly (Python, checks, launches): blocks of ``--calls`` x 10
    # calls of each kind, interleaved, ``--eager-blocks`` times, so that a change of the host's speed
    # during the run hits every kind alike; medians per call. "record launch only" is the recorded
    # call's record-kernel launch alone (its plan launched directly), "wrapper, no launch" the
    # recorded call with that launch replaced by nothing: together they split the recorder's cost.
    unwrapped = mod.fused_musespark1x_routing.__wrapped__
    torch.cuda.synchronize()
    first_plan = next(iter(ring.plans.values()), None)  # (site, launch) of the eager calls' signature
    record_launch = None if first_plan is None else first_plan[1]
    stream = torch.cuda.current_stream().cuda_stream

    def eager_plain(layer):
        unwrapped(logits[layer], bias[layer], K, 2.5, None, "sigmoid", 1e-20, weights[layer], ids[layer],
                  is_padding=pad)

    def eager_recorded(layer):
        mod.fused_musespark1x_routing(logits[layer], bias[layer], K, 2.5, None, "sigmoid", 1e-20, weights[layer],
                                      ids[layer], is_padding=pad)

    def launch_only(layer):
        record_launch.direct(stream, logits[layer].data_ptr(), bias[layer].data_ptr(), pad.data_ptr(),
                             weights[layer].data_ptr(), ids[layer].data_ptr(), -1, 0)

    kinds = {"eager plain": eager_plain, "eager recorded": eager_recorded}
    if record_launch is not None:
        kinds["record launch only"] = launch_only
    eager_blocks: dict[str, list[float]] = {name: [] for name in kinds}
    if record_launch is not None:
        eager_blocks["wrapper, no launch"] = []
    for _ in range(args.eager_blocks):
        for name, fn in kinds.items():
            t0 = time.perf_counter()
            for _ in range(10):
                for layer in range(L):
                    fn(layer)
            eager_blocks[name].append((time.perf_counter() - t0) * 1e6 / (10 * L))
        if record_launch is not None:
            record_launch.direct = lambda *a: None
            try:
                t0 = time.perf_counter()
                for _ in range(10):
                    for layer in range(L):
                        eager_recorded(layer)
                eager_blocks["wrapper, no launch"].append((time.perf_counter() - t0) * 1e6 / (10 * L))
            finally:
                del record_launch.direct  # (the class's method again)
        torch.cuda.synchronize()
        rec.flush()  # (untimed: the ring never fills)
    eager = {name: statistics.median(v) for name, v in eager_blocks.items()}
    eager_q = {name: _quantiles(v) for name, v in eager_blocks.items()}
    rec.close()
    stats = rec.stats

    plain_q = _quantiles(times["plain"])
    rows = []
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "commit": results.commit(),
        "shape": {"tokens": T, "experts": E, "topk": K, "dtype": "bfloat16", "calls_per_graph": L},
        "replays": args.replays, "repeats": args.repeats,
        "graphs_latency_us_per_replay": {k: _quantiles(v) for k, v in times.items()},
        "eager_host_latency_us_per_call": eager,
        "eager_host_latency_us_per_call_quantiles": eager_q,
        "eager_ratio_recorded_to_plain": eager["eager recorded"] / eager["eager plain"],
        "overhead_latency_us_per_call": {},
        "recorder": {"steps_written": stats.steps_written, "steps_dropped": stats.steps_dropped,
                     "steps_too_large": stats.steps_too_large, "calls_seen": stats.calls_seen},
    }
    for name, values in times.items():
        if name == "plain":
            continue
        base = [0.0] * len(values) if name == "record-only" else times["plain"]
        per_call = _quantiles([(v - b) / L for v, b in zip(values, base)])
        result["overhead_latency_us_per_call"][name] = per_call
        rows.append((name, per_call))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.csv:
        results.append(_rows(result), args.csv)
    print(f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}; {T} tokens x {E} experts bf16, "
          f"top-{K}, {L} calls per graph, {args.replays} replays x {args.repeats} repeats")
    print(f"plain graph: {plain_q['p50'] / L:.2f} us per routing call (p10 {plain_q['p10'] / L:.2f}, "
          f"p90 {plain_q['p90'] / L:.2f})")
    print(f"{'overhead per routing call (latency_us)':58s} {'p50':>7s} {'p10':>7s} {'p90':>7s}")
    for name, q in rows:
        label = name if name != "record-only" else "record-only (the record kernel alone, per call)"
        print(f"{label:58s} {q['p50']:7.2f} {q['p10']:7.2f} {q['p90']:7.2f}")
    print(f"eager host time per call (median of {args.eager_blocks} interleaved blocks): "
          f"{eager['eager plain']:.1f} us plain, {eager['eager recorded']:.1f} us recorded "
          f"({result['eager_ratio_recorded_to_plain']:.2f}x)")
    for name in eager:
        if name not in ("eager plain", "eager recorded"):
            print(f"  {name}: {eager[name]:.1f} us (p10 {eager_q[name]['p10']:.1f}, p90 {eager_q[name]['p90']:.1f})")
    print(f"recorder: {stats.steps_written} steps written, {stats.steps_dropped} dropped (ring full), "
          f"{stats.steps_too_large} too large; {stats.calls_seen} calls seen")
    ok = stats.steps_dropped == 0 and stats.steps_written >= steps_replayed
    if not ok:
        print(f"bench_recorder: expected {steps_replayed} steps written and none dropped", file=sys.stderr)
    return 0 if ok else 1


def _rows(result: dict) -> list[list]:
    """``result`` as results-file rows: ``[machine, "recorder", case, metric, value, unit]``."""
    sh = result["shape"]
    shape = f"T={sh['tokens']} E={sh['experts']} k={sh['topk']} bf16 {sh['calls_per_graph']} calls/graph"
    machine, calls = result["gpu"], sh["calls_per_graph"]
    out = []
    plain = result["graphs_latency_us_per_replay"]["plain"]
    for q in ("p50", "p10", "p90"):
        out.append([machine, "recorder", f"plain tiled call {shape}", f"latency_us_{q}", f"{plain[q] / calls:.4g}", "us"])
    for name, qs in result["overhead_latency_us_per_call"].items():
        for q in ("p50", "p10", "p90"):
            out.append([machine, "recorder", f"overhead {name} {shape}", f"latency_us_{q}", f"{qs[q]:.4g}", "us"])
    for name, value in result["eager_host_latency_us_per_call"].items():
        out.append([machine, "recorder", f"{name} {shape}", "host_us_median", f"{value:.4g}", "us"])
    out.append([machine, "recorder", f"eager recorded / plain {shape}", "ratio",
                f"{result['eager_ratio_recorded_to_plain']:.3g}", "x"])
    return out


if __name__ == "__main__":
    sys.exit(main())
