"""The recorder's device ring (routetool.capture.ring) and its record kernel, on the CPU.

The record kernel (routetool.capture.ring_kernel) runs here under the Triton interpreter on CPU
tensors and must leave the ring exactly as the CPU implementation does; the recorder tests
(test_recorder.py, test_capture_model.py) go through the CPU implementation.
"""

import json

import pytest
import torch

from routetool.capture import ring as R
from routetool.capture.recorder import RoutingRecorder
from standin_engine import E, K
from test_recorder import TARGET, FakeEngine, _expected, fake_module  # noqa: F401  (a fixture)
from routetool.errors import RouteToolError
from routetool.io.trace import open_trace
from conftest import DEVICE


def _ring(**kw) -> R.DeviceRing:
    args = dict(ring_bytes=40_000, steps=6, max_layers=4, num_layers=3, skip_steps=0, every_n_steps=1,
                max_tokens=-1, record_outputs=True, device="cpu")
    args.update(kw)
    ring = R.DeviceRing(**args)
    ring.bind(E, K, torch.bfloat16, torch.float32)
    ring.buf.zero_()  # rows that are never written compare equal too
    return ring


def _calls(seed: int = 0):
    """A sequence of calls that takes every branch of the kernel's sampling: steps by call count, an
    explicit position that repeats, a step that fits nowhere (too large), a full ring, release and
    wrap-around, a step of zero rows, no padding, a strided gating_output, int64 ids, a bias that
    changes (the host compares biases) and a last step over the token budget; boundaries, one of
    them for a step the run stopped inside."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(E, generator=g)
    sizes = [5, 9, 3, 0, 7, 160, 100, 2, 30, 2, 2, 11, 2, 40]
    for step, n in enumerate(sizes):
        for layer in range(3):
            x = torch.randn(n, 2 * E, generator=g).to(torch.bfloat16)[:, ::2]
            pad = (torch.rand(n, generator=g) < 0.3) if step % 3 else None
            w = torch.rand(n, K, generator=g)
            ids = torch.randint(0, E, (n, K), generator=g)
            b = bias + 1 if step == len(sizes) - 1 else bias
            position = 0 if (step == 9 and layer == 2) else -1  # layer position 0 again: a new step
            yield x, b, pad, w, ids, position
        if step in (4, 10):
            yield "release"
        if step == 2:
            yield "end_step"
        if step == 9:  # the step the repeated position began has 1 call: ended as interrupted (not judged)
            yield "interrupted"


def _steps(plan, seed: int = 1):
    """Calls of ``plan``: per step, the rows of each call (by call order), then "end_step",
    "interrupted" (a boundary where the run stopped inside the step) or nothing (no boundary)."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(E, generator=g)
    for rows, boundary in plan:
        for n in rows:
            x = torch.randn(n, E, generator=g).to(torch.bfloat16)
            yield x, bias, None, torch.rand(n, K, generator=g), torch.randint(0, E, (n, K), generator=g), -1
        if boundary:
            yield boundary


SEQUENCES = {
    "sampling": (_calls, dict(max_tokens=190)),
    # boundaries: a whole step, two whole steps between two boundaries (an engine's dummy forward),
    # a step the run stopped inside (flagged, not judged), then a step that ends short: refused
    "short-step": (lambda: _steps([([4, 4, 4], "end_step"), ([3, 3, 3, 2, 2, 2], "end_step"),
                                    ([5, 5], "interrupted"), ([6, 6, 6], "end_step"), ([7, 7], "end_step"),
                                    ([8, 8, 8], "end_step")]), {}),
    # no boundaries: a call of other rows than its step's is refused (here the step is recorded)
    "other-rows": (lambda: _steps([([4, 4, 4], None), ([5, 5, 6], None), ([2, 2, 2], None)]), {}),
}


@pytest.mark.parametrize("rows_per_program", [None, 4], ids=["one-program", "several-programs"])
@pytest.mark.parametrize("sequence", list(SEQUENCES))
def test_kernel_matches_the_cpu_implementation(rows_per_program, sequence):
    # the kernels on DEVICE: interpreted on CPU tensors here, compiled on a GPU machine
    from routetool.capture.ring_kernel import end_step_call, record_routing_call

    calls, kw = SEQUENCES[sequence]
    cpu, kern = _ring(**kw), _ring(device=DEVICE, **kw)
    kern.rows_per_program = rows_per_program
    for item in calls():
        if item == "release":
            for ring in (cpu, kern):
                s = ring.state.tolist()
                ring.release(s[R.STATE_HEAD_ROWS], s[R.STATE_HEAD_STEPS])
        elif item in ("end_step", "interrupted"):
            R._end_step_cpu(cpu, item == "interrupted")
            end_step_call(kern, item == "interrupted")
        else:
            x, b, pad, w, ids, position = item
            R._record_cpu(cpu, x, b, pad, w, ids.to(torch.int32), position, 0)
            on = [t.to(DEVICE) if t is not None else None for t in (x, b, pad, w, ids)]
            record_routing_call(kern, *on, position, 0)
        assert cpu.state.tolist() == kern.state.tolist()
        assert torch.equal(cpu.buf, kern.buf.cpu())
    s = cpu.state.tolist()
    flags = cpu.steps_table[:, R.STEP_FLAGS].tolist()
    if sequence == "sampling":  # every branch was taken
        assert s[R.STATE_DROPPED_LARGE] >= 1 and s[R.STATE_DROPPED_FULL] >= 1
        assert s[R.STATE_STOPPED] == R.STOPPED_BUDGET  # the last step went over max_tokens
        assert s[R.STATE_HEAD_ROWS] > cpu.layout.rows  # wrapped around
        assert s[R.STATE_STEPS_SEEN] == 15  # 14 steps and the one the repeated position began
        assert s[R.STATE_MISMATCH_STEP] == 0 and flags.count(R.STEP_INTERRUPTED) <= 1
        assert R.STEP_MISMATCHED not in flags
    elif sequence == "short-step":
        # steps 0, 1, 2 whole; 3 interrupted (flagged only); 4 whole; 5 ends after 2 calls: refused
        assert s[R.STATE_STOPPED] == R.STOPPED_MISMATCH and s[R.STATE_MISMATCH_STEP] == 5 + 1
        assert (s[R.STATE_MISMATCH_KIND], s[R.STATE_MISMATCH_CALLS]) == (R.MISMATCH_CALLS, 2)
        assert s[R.STATE_HEAD_STEPS] == 6  # nothing claimed after the refusal
        assert flags[:6] == [0, 0, 0, R.STEP_INTERRUPTED, 0, R.STEP_MISMATCHED]
    else:
        assert s[R.STATE_STOPPED] == R.STOPPED_MISMATCH and s[R.STATE_MISMATCH_STEP] == 1 + 1
        assert (s[R.STATE_MISMATCH_KIND], s[R.STATE_MISMATCH_CALLS]) == (R.MISMATCH_ROWS, 3)
        assert (s[R.STATE_MISMATCH_ROWS], s[R.STATE_MISMATCH_STEP_ROWS]) == (6, 5)
        assert s[R.STATE_HEAD_STEPS] == 2 and flags[:2] == [0, R.STEP_MISMATCHED]


def test_drained_steps_are_exact_across_laps(fake_module, tmp_path, monkeypatch):
    # a ring of ~250 rows drained at every call: several laps, nothing dropped, every step exact
    # (copies are not held back for a writer that lags behind on a loaded machine: the laps are the point here)
    from routetool.capture import recorder as recorder_mod

    monkeypatch.setattr(recorder_mod, "_MAX_COPIES_IN_FLIGHT", 1 << 30)
    out = tmp_path / "run.json"
    engine = FakeEngine(fake_module)
    sizes = [(n % 13 + 1, n % 3) for n in range(60)]
    with RoutingRecorder(out, target=TARGET, num_layers=3, ring_mb=0.02, ring_steps=8, drain_interval_s=0,
                         max_layers=3) as rec:
        for step, (n, padded) in enumerate(sizes):
            engine.forward(step, n, padded)
    assert rec.stats.ring_rows < 300 and 3 * rec.stats.tokens_recorded > 3 * rec.stats.ring_rows  # 3 laps
    assert rec.stats.steps_dropped == 0 and rec.stats.steps_written == len(sizes)
    with open_trace(out) as t:
        for pos in range(3):
            for step, call in zip(t.steps(pos), _expected(engine, pos, range(len(sizes))), strict=True):
                assert torch.equal(step.gating_output, call[2]) and torch.equal(step.recorded_ids, call[5])


def test_a_step_larger_than_the_ring_is_dropped_and_counted(fake_module, tmp_path):
    out = tmp_path / "run.json"
    engine = FakeEngine(fake_module)
    with RoutingRecorder(out, target=TARGET, num_layers=3, ring_mb=0.02, ring_steps=8, max_layers=3) as rec:
        for step, n in enumerate((4, 100, 6)):  # 3 calls x 100 rows fit in no ring of ~250 rows
            engine.forward(step, n)
    assert rec.stats.steps_too_large == 1 and rec.stats.steps_written == 2
    index = json.loads(out.read_text())
    assert index["recording"]["dropped_steps_too_large"] == 1
    assert index["shards"][0]["first_step"] == 0 and index["shards"][-1]["last_step"] == 2
    with open_trace(out) as t:
        assert t.info(0).step_offsets == (0, 4, 10)


def test_a_changed_bias_stops_recording_and_keeps_the_steps_before(fake_module, tmp_path):
    out = tmp_path / "run.json"
    engine = FakeEngine(fake_module)
    with pytest.raises(RouteToolError, match="bias of layer 1 changed at step 2"):
        with RoutingRecorder(out, target=TARGET, num_layers=3):
            for step in range(4):
                if step == 2:
                    engine.bias[1] = engine.bias[1] + 0.5  # e.g. an online bias update
                engine.forward(step, 5)
    assert len(engine.calls) == 12  # the run itself went on
    index = json.loads(out.read_text())
    assert index["complete"] is False and "bias of layer 1 changed" in index["stopped_by"]
    with open_trace(out) as t:
        assert t.info(1).num_steps == 2


def test_paused_calls_are_not_stored_and_steps_count_from_resume(fake_module, tmp_path):
    out = tmp_path / "run.json"
    engine = FakeEngine(fake_module)
    with RoutingRecorder(out, target=TARGET, num_layers=3, paused=True, every_n_steps=2, shard_s=3600) as rec:
        engine.forward(0, 16)  # warm-up / profile runs of an engine
        engine.forward(1, 16)
        rec.resume()
        for step, n in enumerate((3, 4, 5, 6), start=2):
            engine.forward(step, n)
    assert rec.stats.calls_seen == 18
    index = json.loads(out.read_text())
    assert [(s["first_step"], s["last_step"]) for s in index["shards"]] == [(0, 2)]  # numbered from the resume
    with open_trace(out) as t:
        assert t.info(0).step_offsets == (0, 3, 8)  # steps 0 and 2 after the resume: 3 and 5 rows
        assert torch.equal(next(t.steps(2)).gating_output, _expected(engine, 2, [2])[0][2])


def test_more_layers_than_max_layers_is_a_recorder_error(fake_module, tmp_path):
    current = {}
    with pytest.raises(RouteToolError, match="more than max_layers=2"):
        with RoutingRecorder(tmp_path / "run.json", target=TARGET, layer_fn=lambda: current["layer"], max_layers=2):
            for layer in (0, 1, 2):
                current["layer"] = layer
                fake_module.fused_musespark1x_routing(torch.randn(3, E), torch.zeros(E), K, 1.0)


def test_ranks_and_recording_facts_in_the_index_and_metadata(fake_module, tmp_path, monkeypatch):
    from routetool.capture.ranks import RankInfo

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    (tmp_path / "run").mkdir()
    out = tmp_path / "run" / "rank-{rank}" / "trace.json"
    with RoutingRecorder(out, target=TARGET, num_layers=3) as rec:
        FakeEngine(fake_module).forward(0, 4)
    index_path = tmp_path / "run" / "rank-3" / "trace.json"
    assert rec.out == index_path
    index = json.loads(index_path.read_text())
    assert index["ranks"] == RankInfo(rank=3, world_size=4, local_rank=1, source="env").as_dict()
    assert index["recording"]["steps_seen"] == 1 and index["recording"]["dropped_steps"] == 0
    with open_trace(index_path) as t:
        assert (t.meta.extra["rank"], t.meta.extra["world_size"], t.meta.extra["rank_source"]) == ("3", "4", "env")
        assert "tp_rank" not in t.meta.extra  # unknown to a plain launcher: not guessed
    given = RankInfo(rank=1, world_size=2, dp_rank=1, dp_size=2, tp_rank=0, tp_size=1, ep_rank=1, ep_size=2)
    with RoutingRecorder(tmp_path / "run" / "rank-{rank}" / "trace.json", target=TARGET, num_layers=3,
                         ranks=given):
        FakeEngine(fake_module).forward(0, 4)
    with open_trace(tmp_path / "run" / "rank-1" / "trace.json") as t:
        assert (t.meta.extra["dp_rank"], t.meta.extra["ep_size"], t.meta.extra["rank_source"]) == ("1", "2", "given")
