"""Recording on the GPU: a small MoE decoder (tests/moe_decoder.py, the tiled kernel as its router)
run eagerly, under torch.compile, as torch.cuda.CUDAGraph replays of the eager model, and as
replays of the compiled model (as vLLM runs decode steps). Each way, the trace holds exactly the
rows the model routed, compared with the model's own outputs, and ``routetool replay`` on it
exits 0.

Marked ``gpu``: skipped on machines without CUDA. (The record kernel's parity with the CPU
implementation runs on the GPU in tests/capture/test_ring.py, which uses the CUDA device when there is one.)
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moe_decoder
from routetool.capture.recorder import RoutingRecorder
from routetool.errors import RouteToolError

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 64
LAYERS = 4
GRAPH_STEPS = [(8, 3), (16, 5), (8, 0), (16, 1), (8, 7), (16, 0), (8, 2), (16, 9), (8, 1), (16, 4)]
EAGER_STEPS = [(300, 0)] + GRAPH_STEPS  # a prefill first: several programs of the record kernel


def _replay(trace: Path) -> subprocess.CompletedProcess:
    # --no-latency: the routing is what is checked here (replay's latency measurement captures the
    # reference in a CUDA graph, which its tie handling cannot be)
    return subprocess.run([sys.executable, "-m", "routetool", "replay", str(trace), "--no-latency", "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True, check=False)


def _steps(model, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    routed = []
    for rows, padded in steps:
        x, pad = moe_decoder.batch(rows, padded, HIDDEN, "cuda", gen)
        _, logits, weights, ids = model(x, pad)
        routed.append((logits.clone(), weights.clone(), ids.clone(), pad.clone()))
    return routed


def _graph_replays(model, steps, seed, rec, boundaries=False):
    """Capture one graph per batch size (warm-up and capture while the recorder is paused, as an
    engine's start-up is), then replay the steps with new inputs copied into the static buffers,
    draining after most replays (``boundaries``: ending each step, as the plugin's step hook does)."""
    graphs = {}
    for size in sorted({rows for rows, _ in steps}):
        x = torch.zeros(size, HIDDEN, device="cuda")
        pad = torch.zeros(size, dtype=torch.bool, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model(x, pad)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = model(x, pad)
        graphs[size] = (graph, x, pad, outs)
    rec.resume()
    gen = torch.Generator().manual_seed(seed)
    routed = []
    for i, (rows, padded) in enumerate(steps):
        graph, x, pad, (_, logits, weights, ids) = graphs[rows]
        new_x, new_pad = moe_decoder.batch(rows, padded, HIDDEN, "cuda", gen)
        x.copy_(new_x)
        pad.copy_(new_pad)
        graph.replay()
        routed.append((logits.clone(), weights.clone(), ids.clone(), new_pad.clone()))
        if boundaries:
            rec.step()
        elif i % 4 != 3:
            rec.drain()
    return routed


@pytest.mark.parametrize("way", ["eager", "compile", "graphs", "compile-graphs"])
def test_three_ways(way, tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = moe_decoder.TinyMoEDecoder(num_layers=LAYERS, hidden=HIDDEN, device="cuda")
    run = torch.compile(model, dynamic=False) if "compile" in way else model
    out = tmp_path / f"{way}.json"
    with RoutingRecorder(out, target=moe_decoder.TARGET, num_layers=LAYERS, ring_mb=16, shard_mb=0.05,
                         paused="graphs" in way) as rec:
        if "graphs" in way:
            routed = _graph_replays(run, GRAPH_STEPS, seed=3, rec=rec)
        else:
            routed = _steps(run, EAGER_STEPS if way == "eager" else GRAPH_STEPS, seed=3)
    if "compile" in way:
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] >= 1
    assert rec.stats.steps_dropped == rec.stats.steps_too_large == rec.stats.calls_dropped == 0
    assert rec.stats.steps_written == len(routed)
    moe_decoder.assert_trace_holds(out, routed)
    res = _replay(out)
    assert res.returncode == 0, res.stdout + res.stderr
    torch._dynamo.reset()


def test_a_full_ring_drops_whole_steps_under_replay(tmp_path):
    # no drain while replaying: a ring of 3 step slots keeps the first 3 steps exactly and drops
    # and counts the rest, never overwriting a step the host has not copied
    model = moe_decoder.TinyMoEDecoder(num_layers=LAYERS, hidden=HIDDEN, device="cuda")
    out = tmp_path / "full.json"
    steps = [(16, 2)] * 8
    with RoutingRecorder(out, target=moe_decoder.TARGET, num_layers=LAYERS, ring_mb=4, ring_steps=3,
                         paused=True, drain_interval_s=1e9) as rec:
        real_drain = rec.drain
        rec.drain = lambda: None  # the replays below drain nothing
        routed = _graph_replays(model, steps, seed=5, rec=rec)
        rec.drain = real_drain
    assert rec.stats.steps_dropped == 5 and rec.stats.steps_written == 3
    assert json.loads(out.read_text())["recording"]["dropped_steps"] == 5
    moe_decoder.assert_trace_holds(out, routed[:3])


def test_a_layer_count_that_disagrees_is_refused_under_replay(tmp_path):
    # num_layers=3 for a 4-layer model, steps ended by the step hook after each graph replay: the
    # end-of-step kernel finds step 1 ending after 1 call (layer 3 began it), recording stops there;
    # step 0 holds layers 0-2, as routed, and nothing is filed under a layer it did not come from
    model = moe_decoder.TinyMoEDecoder(num_layers=LAYERS, hidden=HIDDEN, device="cuda")
    out = tmp_path / "refused.json"
    with pytest.warns(RuntimeWarning, match="step 1 ended with 1 routing call"):
        with pytest.raises(RouteToolError, match="step 1 ended with 1 routing call"):
            with RoutingRecorder(out, target=moe_decoder.TARGET, num_layers=LAYERS - 1, ring_mb=4, paused=True,
                                 shard_mb=0.01) as rec:
                routed = _graph_replays(model, GRAPH_STEPS[:4], seed=7, rec=rec, boundaries=True)
    assert rec.refusal["step"] == 1
    index = json.loads(out.read_text())
    assert index["complete"] is False and index["recording"]["refused"]["step"] == 1
    moe_decoder.assert_trace_holds(out, [tuple(t[: LAYERS - 1] for t in r[:3]) + (r[3],) for r in routed[:1]])


def test_an_interrupted_step_is_dropped_under_replay(tmp_path):
    # the step hook's boundary while an exception propagates (a Ctrl-C inside the model step) ends
    # the step as interrupted: it is dropped, the steps before it stay whole on every layer
    model = moe_decoder.TinyMoEDecoder(num_layers=LAYERS, hidden=HIDDEN, device="cuda")
    out = tmp_path / "interrupted.json"
    with RoutingRecorder(out, target=moe_decoder.TARGET, num_layers=LAYERS, ring_mb=4, paused=True) as rec:
        routed = _graph_replays(model, GRAPH_STEPS[:3], seed=9, rec=rec, boundaries=True)
        x, pad = moe_decoder.batch(8, 1, HIDDEN, "cuda", torch.Generator().manual_seed(1))
        two_layers = moe_decoder.TinyMoEDecoder(num_layers=2, hidden=HIDDEN, device="cuda")
        try:
            try:
                two_layers(x, pad)  # the next step stops after 2 of its 4 layers
                raise KeyboardInterrupt
            finally:
                rec.step()
        except KeyboardInterrupt:
            pass
    index = json.loads(out.read_text())
    assert index["recording"]["not_written"] == [{"step": 3, "why": "interrupted"}]
    moe_decoder.assert_trace_holds(out, routed)
