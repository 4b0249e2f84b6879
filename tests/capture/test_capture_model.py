"""A small MoE decoder recorded eagerly and compiled (tests/moe_decoder.py), on the CPU (on the
GPU where there is one).

The trace holds exactly the rows the model routed, compared with the model's own outputs, and
replays with exit 0. The same model is recorded under CUDA graphs in tests/capture/test_capture_gpu.py.
"""

import json

import pytest
import torch
from click.testing import CliRunner

import moe_decoder
from conftest import DEVICE
from routetool.capture.recorder import RoutingRecorder

STEPS = [(9, 0), (4, 1), (8, 3), (1, 0), (6, 2)]  # (rows, padded rows): a prefill, then padded decodes
HIDDEN = 64


def _run(model, steps, device=DEVICE, seed=1):
    gen = torch.Generator().manual_seed(seed)
    routed = []
    for rows, padded in steps:
        x, pad = moe_decoder.batch(rows, padded, HIDDEN, device, gen)
        _, logits, weights, ids = model(x, pad)
        routed.append((logits, weights, ids, pad))
    return routed


def _replay_exit_code(trace) -> int:
    from routetool.cli import main

    res = CliRunner().invoke(main, ["replay", str(trace), "--device", DEVICE.type, "--no-latency", "--no-progress"])
    return res.exit_code


def test_eager_model(tmp_path):
    model = moe_decoder.TinyMoEDecoder(num_layers=3, hidden=HIDDEN, device=DEVICE)
    out = tmp_path / "eager.json"
    with RoutingRecorder(out, target=moe_decoder.TARGET, num_layers=3, ring_mb=1, shard_mb=0.01,
                         drain_interval_s=0) as rec:
        routed = _run(model, STEPS)
    assert rec.stats.steps_recorded == len(STEPS) and rec.stats.steps_dropped == 0
    assert rec.stats.shards_written > 1
    moe_decoder.assert_trace_holds(out, routed)
    assert _replay_exit_code(out) == 0


def test_compiled_model(tmp_path):
    # compiled before the first call: the op is traced (no graph break) before the ring exists
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = moe_decoder.TinyMoEDecoder(num_layers=2, hidden=HIDDEN, device=DEVICE)
    compiled = torch.compile(model, dynamic=False)
    out = tmp_path / "compiled.json"
    with RoutingRecorder(out, target=moe_decoder.TARGET, num_layers=2, ring_mb=1) as rec:
        routed = _run(compiled, [(4, 1), (4, 0), (4, 2)])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    assert rec.stats.calls_seen == 6
    moe_decoder.assert_trace_holds(out, routed)
    torch._dynamo.reset()


@pytest.mark.parametrize("ring_steps, expect_dropped", [(2, 3), (64, 0)])
def test_a_full_ring_drops_whole_steps(tmp_path, ring_steps, expect_dropped):
    # no drain until the end (as under graph replay with no step hook): the ring holds 2 steps,
    # the other 3 are dropped whole and counted; the kept ones are exact
    model = moe_decoder.TinyMoEDecoder(num_layers=2, hidden=HIDDEN, device=DEVICE)
    out = tmp_path / "full.json"
    with RoutingRecorder(out, target=moe_decoder.TARGET, num_layers=2, ring_mb=1, ring_steps=ring_steps,
                         drain_interval_s=1e9) as rec:
        routed = _run(model, STEPS)
    assert rec.stats.steps_dropped == expect_dropped
    index = json.loads(out.read_text())
    assert index["recording"]["dropped_steps"] == expect_dropped
    assert [s["dropped_steps"] for s in index["shards"]] == [0]  # the drops came after the last kept step
    moe_decoder.assert_trace_holds(out, routed[: len(STEPS) - expect_dropped])
