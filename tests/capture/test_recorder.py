"""The call-site recorder (routetool.capture.recorder) on a CPU stand-in of vLLM's routing module.

The stand-in module has the seed's signature and computes with the one reference
(tests/standin_engine.py); a fake "engine" calls it through the module attribute at call time,
as vLLM does.
"""

import json
import sys
import types

import pytest
import torch

from routetool_kernels.reference import musespark1x_routing_reference
from standin_engine import E, K, fused_musespark1x_routing
from routetool.capture import recorder as recorder_mod
from routetool.capture.recorder import RoutingRecorder
from routetool.errors import RouteToolError
from routetool.io.sharded import ShardedTrace
from routetool.io.trace import Trace, open_trace
from conftest import DEVICE

MODULE = "routetool_test_fake_vllm_routing"
TARGET = f"{MODULE}:fused_musespark1x_routing"


@pytest.fixture
def fake_module(monkeypatch):
    mod = types.ModuleType(MODULE)
    mod.fused_musespark1x_routing = fused_musespark1x_routing
    monkeypatch.setitem(sys.modules, MODULE, mod)
    return mod


class FakeEngine:
    """num_layers MoE layers; every forward step calls the routing function once per layer,
    looked up through the module attribute at call time (as vLLM's MoE layer does)."""

    def __init__(self, module, num_layers=3, seed=0, dtype=torch.bfloat16, route_scale=2.5):
        self.module = module
        self.num_layers = num_layers
        self.gen = torch.Generator().manual_seed(seed)
        self.bias = [torch.randn(E, generator=self.gen) * 0.05 for _ in range(num_layers)]
        self.dtype = dtype
        self.route_scale = route_scale
        self.calls = []  # (step, layer position, gating, padding, weights, ids)

    def forward(self, step, num_tokens, padded=0, layer_hook=None):
        pad = torch.zeros(num_tokens, dtype=torch.bool)
        if padded:
            pad[-padded:] = True
        for pos in range(self.num_layers):
            x = torch.randn((num_tokens, E), generator=self.gen).to(self.dtype)
            if layer_hook is not None:
                layer_hook(pos)
            call = [step, pos, x, pad, None, None]  # the outputs once the call returns
            self.calls.append(call)
            w, ids = self.module.fused_musespark1x_routing(
                x, self.bias[pos], K, self.route_scale, None, "sigmoid", 1e-20,
                torch.empty((num_tokens, K)), torch.empty((num_tokens, K), dtype=torch.int32), is_padding=pad)
            call[4:] = w.clone(), ids.clone()

    def outputs(self, call):
        """What a call routed: its outputs, or (a call interrupted before it returned) the reference's."""
        step, pos, x, pad, w, ids = call
        if w is None:
            w, ids = musespark1x_routing_reference(x, self.bias[pos], K, self.route_scale, None, "sigmoid", 1e-20,
                                                   is_padding=pad)
        return w, ids.to(torch.int32)


STEP_SIZES = [(37, 0), (5, 3), (8, 1), (1, 0), (16, 7)]  # (rows, padded rows): a prefill, then padded decodes


def _run(engine, sizes=STEP_SIZES):
    for step, (n, padded) in enumerate(sizes):
        engine.forward(step, n, padded)


def _expected(engine, pos, steps):
    calls = [c for c in engine.calls if c[1] == pos and c[0] in steps]
    return calls


@pytest.mark.parametrize("background", [True, False], ids=["writer-thread", "inline"])
def test_multi_layer_multi_step_round_trip(fake_module, tmp_path, background):
    out = tmp_path / "run.json"
    engine = FakeEngine(fake_module)
    layer_ids = [3, 4, 7]  # e.g. a model whose first 3 layers are dense, and a gap
    # (shard_s: no shard written by age, however slow a loaded machine runs the five steps)
    with RoutingRecorder(out, target=TARGET, num_layers=3, layer_ids=layer_ids, background=background,
                         shard_s=3600) as rec:
        assert fake_module.fused_musespark1x_routing.__routetool_recorder__ is rec  # (this module's own binding too)
        _run(engine)
    assert fake_module.fused_musespark1x_routing is fused_musespark1x_routing  # original restored
    assert rec.stats.calls_seen == rec.stats.calls_recorded == 15
    assert rec.stats.steps_recorded == 5 and rec.stats.tokens_recorded == sum(n for n, _ in STEP_SIZES)
    index = json.loads(out.read_text())
    assert index["format"] == "routetool-trace-index" and index["complete"] is True
    assert index["stopped_by"] == "exit" and len(index["shards"]) == 1
    with open_trace(out) as t:
        assert isinstance(t, ShardedTrace)
        assert t.layers == tuple(layer_ids)
        r = t.meta.router
        assert (r.num_experts, r.topk, r.route_scale, r.router_score_normalization) == (E, K, 2.5, "sigmoid")
        assert r.router_output_multiplier is None and r.router_score_division_eps == 1e-20
        assert t.meta.extra["weights_semantics"] == "renormalized"
        for pos, layer in enumerate(layer_ids):
            info = t.info(layer)
            sizes = [n for n, _ in STEP_SIZES]
            assert info.step_offsets == tuple(torch.tensor([0] + sizes).cumsum(0).tolist())
            assert info.gating_dtype == torch.bfloat16 and info.has_padding and info.has_recorded_weights
            assert torch.equal(t.bias(layer), engine.bias[pos])
            for step, call in zip(t.steps(layer), _expected(engine, pos, range(5))):
                assert torch.equal(step.gating_output, call[2])  # bit-exact, dtype kept
                assert torch.equal(step.is_padding, call[3])
                assert torch.equal(step.recorded_weights, call[4])
                assert torch.equal(step.recorded_ids, call[5])


def test_replay_of_recorded_trace_matches(fake_module, tmp_path):
    from routetool.engine.execution import load_kernel, select_execution
    from routetool.analysis.replay import replay_trace

    out = tmp_path / "run.json"
    engine = FakeEngine(fake_module, dtype=torch.float32)
    with RoutingRecorder(out, target=TARGET, num_layers=3, shard_mb=0.004):
        _run(engine)
    execution = select_execution(DEVICE.type)
    name, fn = load_kernel("tiled")
    with open_trace(out) as t:
        assert len(t.shards) > 1
        result = replay_trace(t, name, fn, execution, measure_latency=False)
    assert result.ok
    for layer in result.layers:
        rec = layer.reference_vs_recorded
        assert rec.rows == sum(n for n, _ in STEP_SIZES)
        assert rec.mismatch == rec.invalid == rec.weight_rows_over_tolerance == 0
        assert layer.padded_rows == layer.padded_rows_ok == sum(p for _, p in STEP_SIZES)


def test_explicit_layer_index_and_repeat_ends_the_step(fake_module, tmp_path):
    out = tmp_path / "run.json"
    engine = FakeEngine(fake_module, num_layers=2)
    current = {}
    with RoutingRecorder(out, target=TARGET, layer_fn=lambda: current.get("layer")) as rec:
        for step, (n, padded) in enumerate(STEP_SIZES[:3]):
            engine.forward(step, n, padded, layer_hook=lambda pos: current.update(layer=[10, 20][pos]))
    with open_trace(out) as t:
        assert t.layers == (10, 20)
        assert t.info(10).num_steps == 3 == t.info(20).num_steps
    # `with recorder.layer(L)` wins over layer_fn and call order
    out2 = tmp_path / "run2.json"
    with RoutingRecorder(out2, target=TARGET, num_layers=2) as rec:
        for step in range(2):
            for layer in (5, 9):
                with rec.layer(layer):
                    fake_module.fused_musespark1x_routing(torch.randn(4, E), torch.zeros(E), K, 1.0)
    with open_trace(out2) as t:
        assert t.layers == (5, 9) and t.info(5).step_offsets == (0, 4, 8)


def test_explicit_step_boundaries(fake_module, tmp_path):
    out = tmp_path / "run.json"
    with RoutingRecorder(out, target=TARGET, layer_fn=lambda: 0) as rec:
        for n in (3, 6, 2):
            fake_module.fused_musespark1x_routing(torch.randn(n, E), torch.zeros(E), K, 1.0)
            rec.step()
    with open_trace(out) as t:
        assert t.info(0).step_offsets == (0, 3, 9, 11)


def test_sharding_reads_as_one_trace(fake_module, tmp_path):
    sizes = STEP_SIZES * 3
    one, many = tmp_path / "one.json", tmp_path / "many.json"
    for out, shard_mb in ((one, 64), (many, 0.003)):
        with RoutingRecorder(out, target=TARGET, num_layers=3, shard_mb=shard_mb):
            _run(FakeEngine(fake_module, seed=7), sizes)
    index = json.loads(many.read_text())
    assert len(index["shards"]) >= 3
    # shards hold whole steps, in order, and each is a complete trace file by itself
    firsts = [s["first_step"] for s in index["shards"]]
    assert firsts == sorted(firsts) and firsts[0] == 0 and index["shards"][-1]["last_step"] == len(sizes) - 1
    for s in index["shards"]:
        with Trace(tmp_path / s["path"]) as shard:
            assert shard.meta.extra["shard"] == str(index["shards"].index(s))
            assert shard.info(0).num_steps == s["num_steps"]
    with open_trace(one) as a, open_trace(many) as b:
        assert a.layers == b.layers and a.total_tokens == b.total_tokens
        for layer in a.layers:
            assert a.info(layer).step_offsets == b.info(layer).step_offsets
            for sa, sb in zip(a.steps(layer), b.steps(layer)):
                assert (sa.index, sa.start) == (sb.index, sb.start)
                assert torch.equal(sa.gating_output, sb.gating_output)
                assert torch.equal(sa.recorded_ids, sb.recorded_ids)
            # a row range across shard boundaries reads as one
            T = a.info(layer).num_tokens
            ra, rb = a.read_rows(layer, 3, T - 2), b.read_rows(layer, 3, T - 2)
            assert torch.equal(ra.gating_output, rb.gating_output) and torch.equal(ra.is_padding, rb.is_padding)


def test_sampling_every_nth_step_skip_and_token_budget(fake_module, tmp_path):
    sizes = [(n, 0) for n in (4, 5, 6, 7, 8, 9, 10, 11, 12, 13)]
    out = tmp_path / "every3.json"
    engine = FakeEngine(fake_module, seed=3)
    with RoutingRecorder(out, target=TARGET, num_layers=3, every_n_steps=3, skip_steps=1) as rec:
        _run(engine, sizes)
    recorded_steps = [1, 4, 7]  # skip step 0, then every third: 1, 4, 7 (10 is beyond the run)
    assert rec.stats.steps_seen == 10 and rec.stats.steps_recorded == 3
    with open_trace(out) as t:
        for pos in range(3):
            expected = _expected(engine, pos, recorded_steps)
            steps = list(t.steps(pos))
            assert [s.num_tokens for s in steps] == [sizes[i][0] for i in recorded_steps]
            for s, call in zip(steps, expected):
                assert torch.equal(s.gating_output, call[2])

    out = tmp_path / "budget.json"
    with RoutingRecorder(out, target=TARGET, num_layers=3, max_tokens=20) as rec:
        _run(FakeEngine(fake_module), sizes)
    assert rec.stats.tokens_recorded == 4 + 5 + 6  # the step of 7 would exceed 20; steps are never cut
    index = json.loads(out.read_text())
    assert index["complete"] is True and index["stopped_by"] == "max_tokens"
    with open_trace(out) as t:
        assert t.info(0).step_offsets == (0, 4, 9, 15)


def test_exception_mid_run_keeps_everything_recorded(fake_module, tmp_path):
    out = tmp_path / "run.json"
    engine = FakeEngine(fake_module)

    def failing_layer(pos):
        if len(engine.calls) == 3 * 4 + 2:  # step 4, after its first two layers
            raise RuntimeError("CUDA error: out of memory (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        with RoutingRecorder(out, target=TARGET, num_layers=3, shard_mb=0.004):
            for step, (n, padded) in enumerate(STEP_SIZES):
                engine.forward(step, n, padded, layer_hook=failing_layer)
    assert fake_module.fused_musespark1x_routing is fused_musespark1x_routing
    index = json.loads(out.read_text())
    assert index["complete"] is False and index["stopped_by"].startswith("error: RuntimeError")
    # every whole step is readable; the step the run stopped inside is dropped (its layers would
    # have unequal steps) and named
    assert index["recording"]["not_written"] == [{"step": 4, "why": "interrupted"}]
    assert index["last_complete_step"] == 3
    with open_trace(out) as t:
        assert [t.info(layer).num_steps for layer in t.layers] == [4, 4, 4]
        _assert_recorded_as_routed(t, engine, range(4))


def _assert_recorded_as_routed(t, engine, steps, layers=None):
    """Every row of ``t`` is what ``engine`` routed at that step and layer (bit for bit), and
    each layer holds exactly ``steps``."""
    layers = layers if layers is not None else list(range(engine.num_layers))
    assert t.layers == tuple(layers)
    for pos in layers:
        expected = _expected(engine, pos, list(steps))
        got = list(t.steps(pos))
        assert len(got) == len(expected) == len(list(steps))
        for step, call in zip(got, expected):
            assert torch.equal(step.gating_output, call[2])
            assert torch.equal(step.is_padding, call[3])
            w, ids = engine.outputs(call)
            assert torch.equal(step.recorded_weights, w) and torch.equal(step.recorded_ids, ids)
            assert torch.equal(t.bias(pos), engine.bias[pos])


def test_calls_during_graph_capture_are_recorded(fake_module, tmp_path, monkeypatch):
    # the record op is device work: a call inside CUDA-graph capture is recorded like any other
    # call, where the recorder used to refuse it (on the GPU the capture records the op's kernel
    # and every replay repeats it: tests/capture/test_capture_gpu.py); a CPU ring is never captured
    out = tmp_path / "run.json"
    engine = FakeEngine(fake_module)
    with RoutingRecorder(out, target=TARGET, num_layers=3, drain_interval_s=0):
        engine.forward(0, 8)
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
            engine.forward(1, 8)
            engine.forward(2, 5)
    index = json.loads(out.read_text())
    assert index["complete"] is True
    with open_trace(out) as t:
        assert t.info(0).step_offsets == (0, 8, 16, 21)
        for step, call in zip(t.steps(2), _expected(engine, 2, range(3))):
            assert torch.equal(step.gating_output, call[2])


def test_recording_nothing_is_an_error(fake_module, tmp_path):
    with pytest.raises(RouteToolError, match="saw no call.*targets="):
        with RoutingRecorder(tmp_path / "run.json", target=TARGET, num_layers=3):
            pass
    assert not (tmp_path / "run.json").exists()


def test_callers_that_imported_the_function_are_found(fake_module, tmp_path, monkeypatch):
    caller = types.ModuleType("routetool_test_fake_caller")
    caller.route = fake_module.fused_musespark1x_routing  # `from m import fused_musespark1x_routing as route`
    monkeypatch.setitem(sys.modules, caller.__name__, caller)

    def step():
        caller.route(torch.randn(3, E), torch.zeros(E), K, 1.0)

    with RoutingRecorder(tmp_path / "a.json", target=TARGET, num_layers=1) as rec:
        step()
        step()
    assert rec.stats.calls_recorded == 2
    assert f"{caller.__name__}.route" in rec.stats.bindings and f"{TARGET.replace(':', '.')}" in rec.stats.bindings
    assert caller.route is fused_musespark1x_routing  # restored


def test_disk_full_stops_recording_without_disturbing_the_run(fake_module, tmp_path, monkeypatch):
    out = tmp_path / "run.json"
    real_write = recorder_mod.write_trace
    written = []

    def write_then_fill_disk(path, *a, **kw):
        if written:
            raise RouteToolError("cannot write ([Errno 28] No space left on device)", path=path,
                                 fix="check free disk space and permissions")
        written.append(path)
        return real_write(path, *a, **kw)

    monkeypatch.setattr(recorder_mod, "write_trace", write_then_fill_disk)
    engine = FakeEngine(fake_module)
    with pytest.raises(RouteToolError, match="No space left on device"):
        with RoutingRecorder(out, target=TARGET, num_layers=3, shard_mb=0.004, background=True):
            _run(engine, STEP_SIZES * 2)
    # the run itself completed, every call with correct outputs
    assert len(engine.calls) == 30
    for _, pos, x, pad, w, ids in engine.calls:
        ref_w, ref_ids = musespark1x_routing_reference(x, engine.bias[pos], K, 2.5, None, "sigmoid", 1e-20,
                                                       is_padding=pad)
        assert torch.equal(ids, ref_ids.to(torch.int32)) and torch.equal(w, ref_w)
    index = json.loads(out.read_text())
    assert index["complete"] is False and "No space left" in index["stopped_by"]
    assert len(index["shards"]) == 1
    with open_trace(out) as t:
        assert t.info(0).num_steps >= 1


def test_router_parameter_change_stops_recording_but_not_the_run(fake_module, tmp_path):
    out = tmp_path / "run.json"
    with pytest.raises(RouteToolError, match="router parameters changed"):
        with RoutingRecorder(out, target=TARGET, num_layers=1):
            fake_module.fused_musespark1x_routing(torch.randn(3, E), torch.zeros(E), K, 1.0)
            w, ids = fake_module.fused_musespark1x_routing(torch.randn(3, E), torch.zeros(E), K, 2.0)
            assert w.sum(-1).allclose(torch.full((3,), 2.0))  # the call itself still works
    with open_trace(out) as t:
        assert t.info(0).num_steps == 1 and t.meta.router.route_scale == 1.0


def test_record_outputs_off(fake_module, tmp_path):
    out = tmp_path / "run.json"
    with RoutingRecorder(out, target=TARGET, num_layers=3, record_outputs=False):
        _run(FakeEngine(fake_module))
    with open_trace(out) as t:
        assert not t.info(0).has_recorded_ids and "weights_semantics" not in t.meta.extra


@pytest.mark.parametrize("kwargs, message", [
    (dict(target="no_such_module_xyz:f"), "cannot import module"),
    (dict(target=f"{MODULE}"), "is not module:function"),
    (dict(target=f"{MODULE}:missing"), "has no attribute"),
    (dict(target="math:sqrt"), "signature"),
])
def test_bad_targets(fake_module, tmp_path, kwargs, message):
    with pytest.raises(RouteToolError, match=message):
        RoutingRecorder(tmp_path / "run.json", num_layers=1, **kwargs).start()


def test_default_target_is_the_seed_module(tmp_path):
    # vLLM is not installed here: the default target names the seed's module and fails clearly
    rec = RoutingRecorder(tmp_path / "run.json", num_layers=1)
    assert rec.target == "vllm.models.muse_spark.common.ops.fused_routing:fused_musespark1x_routing"
    with pytest.raises(RouteToolError, match="cannot import module 'vllm.models.muse_spark"):
        rec.start()


def test_outputs_are_never_overwritten_without_force(fake_module, tmp_path):
    out = tmp_path / "run.json"
    with RoutingRecorder(out, target=TARGET, num_layers=3):
        _run(FakeEngine(fake_module))
    before = out.read_bytes()
    with pytest.raises(RouteToolError, match="already exists.*force=True"):
        RoutingRecorder(out, target=TARGET, num_layers=3)
    # a leftover shard of the same name is protected too
    (tmp_path / "run.json").rename(tmp_path / "moved.json")
    with pytest.raises(RouteToolError, match="run-00000.safetensors: already exists"):
        RoutingRecorder(out, target=TARGET, num_layers=3)
    (tmp_path / "moved.json").rename(out)
    assert out.read_bytes() == before
    with RoutingRecorder(out, target=TARGET, num_layers=3, force=True):
        _run(FakeEngine(fake_module, seed=5), STEP_SIZES[:2])
    with open_trace(out) as t:
        assert t.info(0).num_steps == 2


@pytest.mark.parametrize("make, kwargs, message", [
    (lambda p: p / "run.safetensors", {}, "name its index file"),
    (lambda p: p / "missing" / "run.json", {}, "folder does not exist"),
    # a file where the folder belongs: named as a file, not as a missing folder
    (lambda p: (p / "notes.txt").write_text("x") and p / "notes.txt" / "run.json", {},
     "notes.txt: is a file, not a folder"),
    (lambda p: p / "run.json", dict(num_layers=None), "give num_layers"),
    (lambda p: p / "run.json", dict(num_layers=3, layer_ids=[0, 1]), "layer_ids has 2"),
    (lambda p: p / "run.json", dict(every_n_steps=0), "every_n_steps"),
    (lambda p: p / "run.json", dict(shard_mb=0), "shard_mb"),
])
def test_bad_parameters(tmp_path, make, kwargs, message):
    kw = dict(num_layers=3, target=TARGET)
    kw.update(kwargs)
    with pytest.raises(RouteToolError, match=message):
        RoutingRecorder(make(tmp_path), **kw)


def test_start_close_api_and_atexit(fake_module, tmp_path):
    import atexit

    registered = []
    real_register = atexit.register
    rec = RoutingRecorder(tmp_path / "a.json", target=TARGET, num_layers=3)
    try:
        atexit.register = lambda fn: registered.append(fn) or real_register(fn)
        rec.start()
    finally:
        atexit.register = real_register
    assert registered == [rec._atexit]  # a started recorder is closed at interpreter exit
    _run(FakeEngine(fake_module), STEP_SIZES[:2])
    rec._atexit()  # what interpreter exit does: close, writing everything
    assert fake_module.fused_musespark1x_routing is fused_musespark1x_routing
    with open_trace(tmp_path / "a.json") as t:
        assert t.info(0).num_steps == 2
    rec.close()  # idempotent
    # at exit, a recorder problem is a warning, not a traceback
    empty = RoutingRecorder(tmp_path / "b.json", target=TARGET, num_layers=3).start()
    with pytest.warns(UserWarning, match="saw no call"):
        empty._atexit()


def test_weights_semantics_written_is_a_documented_value(fake_module, tmp_path):
    # the trace reader refuses any weights_semantics but renormalized / unnormalized
    from routetool.io.trace import WEIGHTS_SEMANTICS

    out = tmp_path / "run.json"
    with RoutingRecorder(out, target=TARGET, num_layers=3, shard_mb=0.002):
        _run(FakeEngine(fake_module))
    with open_trace(out) as t:
        assert len(t.shards) > 1
        for shard in t.shards:
            assert shard.meta.extra["weights_semantics"] in WEIGHTS_SEMANTICS
            assert shard.meta.extra["weights_semantics"] == "renormalized"  # the seed always renormalises


# -- a recorder knows its calls per step (the calls of a 3-layer model, counted with another num_layers)
def _steps_with_boundaries(rec, engine, sizes):
    for step, (n, padded) in enumerate(sizes):
        engine.forward(step, n, padded)
        rec.step()  # the step hook


@pytest.mark.parametrize("num_layers, boundaries, sizes, written, message", [
    # step 0 counts layers 0-1; layer 2 begins step 1, which the boundary ends after 1 call
    (2, True, STEP_SIZES, [0], "step 1 ended with 1 routing call"),
    # step 0 ends after 3 of 4 calls: nothing is written
    (4, True, STEP_SIZES, [], "step 0 ended with 3 routing call"),
    # no boundaries (STEP_HOOK=none): layer 2 of step 0 (37 rows) and layer 0 of step 1 (5 rows) in one step
    (2, False, STEP_SIZES, [0], "call 2 of step 1 routes 5 rows, the step's first call 37"),
    (4, False, STEP_SIZES, [], "call 4 of step 0 routes 5 rows, the step's first call 37"),
], ids=["2-of-3-step-hook", "4-of-3-step-hook", "2-of-3-no-hook", "4-of-3-no-hook"])
def test_a_layer_count_that_disagrees_is_refused_and_nothing_is_misfiled(fake_module, tmp_path, num_layers,
                                                                         boundaries, sizes, written, message):
    out = tmp_path / "run.json"
    engine = FakeEngine(fake_module)  # 3 MoE layers
    with pytest.warns(RuntimeWarning, match=message) as warned:
        with pytest.raises(RouteToolError, match=message):
            with RoutingRecorder(out, target=TARGET, num_layers=num_layers, drain_interval_s=0, shard_mb=0.001) as rec:
                if boundaries:
                    _steps_with_boundaries(rec, engine, sizes)
                else:
                    _run(engine, sizes)
    assert len([w for w in warned if "routetool recorder" in str(w.message)]) == 1  # warned once
    assert len(engine.calls) == 3 * len(sizes)  # the run itself went on
    assert rec.refusal["step"] == (written[-1] + 1 if written else 0)
    if not written:
        assert not out.exists()
        return
    index = json.loads(out.read_text())
    assert index["complete"] is False and message in index["stopped_by"]
    assert index["recording"]["refused"]["step"] == rec.refusal["step"]
    with open_trace(out) as t:  # only rows of the layers they came from
        _assert_recorded_as_routed(t, engine, written, layers=list(range(num_layers)))


def test_without_boundaries_a_wrong_count_shows_in_the_bias(fake_module, tmp_path):
    # equal batch sizes and no step hook: the rows cannot tell; each layer's own bias can (the host
    # compares every call's bias with its layer's first), before the step is written
    out = tmp_path / "run.json"
    engine = FakeEngine(fake_module)
    with pytest.raises(RouteToolError, match=r"bias of layer 0 changed at step 1 \(calls are counted into layers"):
        with RoutingRecorder(out, target=TARGET, num_layers=2):
            _run(engine, [(8, 0)] * 4)
    with open_trace(out) as t:
        _assert_recorded_as_routed(t, engine, [0], layers=[0, 1])


def test_whole_extra_forwards_between_boundaries_are_steps(fake_module, tmp_path):
    # an engine may run whole forwards outside its step hook (vLLM's dummy batches under data
    # parallelism): a whole number of num_layers calls between two boundaries is no disagreement
    out = tmp_path / "run.json"
    engine = FakeEngine(fake_module)
    with RoutingRecorder(out, target=TARGET, num_layers=3) as rec:
        engine.forward(0, 5)
        rec.step()
        engine.forward(1, 1)  # a dummy forward
        engine.forward(2, 7)
        rec.step()
    assert rec.refusal is None
    with open_trace(out) as t:
        _assert_recorded_as_routed(t, engine, range(3))


def test_a_copy_interrupted_on_its_way_to_the_writer_is_handed_over_again_and_taken_once(fake_module, tmp_path,
                                                                                         monkeypatch):
    # Ctrl-C between taking a landed copy off the queue and handing it to the writer lost its
    # steps; the copy now leaves the queue only once handed over, and the writer takes it once
    # even when the interruption came after the hand-over
    out = tmp_path / "run.json"
    engine = FakeEngine(fake_module)
    submit, seen = RoutingRecorder._submit, []

    def interrupted(self, copy):
        seen.append(copy)
        if len(seen) == 1:
            raise KeyboardInterrupt  # before the hand-over
        submit(self, copy)
        if len(seen) == 2:
            raise KeyboardInterrupt  # after it: the same copy is handed over once more

    monkeypatch.setattr(RoutingRecorder, "_submit", interrupted)
    with RoutingRecorder(out, target=TARGET, num_layers=3, drain_interval_s=0) as rec:
        for step, n in enumerate((5, 7, 4)):
            engine.forward(step, n, padded=1)
            rec.step()
            for _ in range(2):
                try:
                    rec.flush()
                except KeyboardInterrupt:
                    pass
    assert seen[0] is seen[1] is seen[2]  # the first copy, offered three times
    with open_trace(out) as t:
        _assert_recorded_as_routed(t, engine, range(3))


def test_an_interrupt_at_any_line_of_the_recorder_leaves_only_steps_as_routed(fake_module, tmp_path):
    # a SIGINT lands between two Python lines of the thread that runs the model: raise
    # KeyboardInterrupt at the k-th line the recorder (wrapper, record op, CPU ring, drain, step
    # boundary) runs during step 2, for k across the ~900 lines of that step; what is written is
    # whole steps, each exactly as routed, on every layer alike
    files = {recorder_mod.__file__, *(sys.modules[f"routetool.capture.{m}"].__file__ for m in ("ring", "ring_layout"))}
    lines = [0]
    stop_at = [0]

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename in files else None

    def local(frame, event, arg):
        if event == "line":
            lines[0] += 1
            if lines[0] == stop_at[0]:
                raise KeyboardInterrupt
        return local

    for k in range(1, 1000, 15):
        lines[0], stop_at[0] = 0, k
        out = tmp_path / f"run-{k}.json"
        engine = FakeEngine(fake_module)
        with pytest.raises(KeyboardInterrupt):
            with RoutingRecorder(out, target=TARGET, num_layers=3, drain_interval_s=0) as rec:
                for step, n in enumerate((5, 7)):
                    engine.forward(step, n, padded=1)
                    rec.step()
                sys.settrace(tracer)
                try:
                    engine.forward(2, 4, padded=2)
                    rec.step()
                finally:
                    sys.settrace(None)
                raise KeyboardInterrupt  # (k beyond the step's lines)
        index = json.loads(out.read_text())
        assert index["complete"] is False and index["stopped_by"] == "error: KeyboardInterrupt: "
        steps = index["last_complete_step"] + 1
        assert steps in (2, 3), k
        with open_trace(out) as t:
            _assert_recorded_as_routed(t, engine, range(steps))


_KILLED_RECORDING = """
import os, signal, sys, time, types
sys.path[:0] = {paths!r}
from standin_engine import fused_musespark1x_routing
from test_recorder import FakeEngine, MODULE, TARGET
from routetool.capture import recorder as recorder_mod

mod = types.ModuleType(MODULE)
mod.fused_musespark1x_routing = fused_musespark1x_routing
sys.modules[MODULE] = mod
# by-age: every drained step is written at once (shard_s=0); else only flush() and close() write
by_age = {mode!r} == "by-age"
rec = recorder_mod.RoutingRecorder({out!r}, target=TARGET, num_layers=3, shard_s=0 if by_age else 3600,
                                   drain_interval_s=0).start()
engine = FakeEngine(mod)
for step in range(10):
    engine.forward(step, 3 + step % 4, padded=step % 2)
if not by_age:
    rec.flush()
for step in range(10, 15):
    engine.forward(step, 2)
if by_age:  # drains hand every complete step to the writer, which writes them by age (no flush)
    for _ in range(3):
        with rec._lock:
            rec._drain(wait=True)
        rec._executor.submit(lambda: None).result()
if {mode!r} != "in-close":
    print("recorded", flush=True)
    time.sleep(120)
else:  # killed inside close, at its first file write
    recorder_mod.write_trace = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    rec.close()
"""


@pytest.mark.parametrize("mode", ["after-flush", "in-close", "by-age"])
def test_a_killed_recording_keeps_every_flushed_step(fake_module, tmp_path, mode):
    # SIGKILL (no atexit, no close) after flush(), or while close() drains and writes: every step
    # recorded before flush() is on disk, whole and listed; the index says the recording did not end.
    # by-age (shard_s=0, no flush): every step drained before the kill is on disk
    import signal
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parents[1]  # tests/
    out = tmp_path / "run.json"
    paths = [str(here), str(here / "capture"), str(here.parent)]
    script = _KILLED_RECORDING.format(paths=paths, out=str(out), mode=mode)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if mode != "in-close":
            assert proc.stdout.readline() == "recorded\n", proc.stderr.read()
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    index = json.loads(out.read_text())
    assert index["complete"] is False and index["stopped_by"] is None
    steps = index["last_complete_step"] + 1
    if mode == "by-age":  # shards written as steps were drained, without a flush; the ring's last steps are lost
        assert steps >= 5 and len(index["shards"]) > 1, (steps, index["shards"])
    else:
        assert steps == 10
    engine = FakeEngine(fake_module)  # the same calls again (same seed)
    for step in range(15):
        engine.forward(step, 3 + step % 4, padded=step % 2) if step < 10 else engine.forward(step, 2)
    with open_trace(out) as t:
        _assert_recorded_as_routed(t, engine, range(steps))
    # info says so, and names the last complete step
    from click.testing import CliRunner

    from routetool.cli import main

    result = CliRunner().invoke(main, ["info", str(out), "--json", str(tmp_path / "info.json")], env={"COLUMNS": "250"})
    assert "INCOMPLETE" in result.output and f"last complete step: {steps - 1}" in result.output, result.output
    assert json.loads((tmp_path / "info.json").read_text())["index"]["last_complete_step"] == steps - 1


def test_a_signatures_plan_is_checked_once_then_launched_directly(fake_module, tmp_path, monkeypatch):
    # the eager hot path on a CUDA ring, with its launches stood in for on the CPU: the first call of
    # a signature is checked and leaves a plan; later calls launch it directly with their own data
    # pointers and positions; a call of another signature (here a new dtype) is checked again
    from routetool_kernels import _dispatch

    class Launch:
        can_direct = True
        direct_calls: list = []

        def direct(self, stream, *args):
            self.direct_calls.append(args)

    monkeypatch.setattr(_dispatch._Driver, "current_device", staticmethod(lambda: 0))
    monkeypatch.setattr(_dispatch._Driver, "current_stream", staticmethod(lambda device: 7))
    out = tmp_path / "run.json"
    rec = RoutingRecorder(out, target=TARGET, num_layers=2, drain_interval_s=1e9).start()
    call = fake_module.fused_musespark1x_routing
    x = [torch.randn(4, E).to(torch.bfloat16) for _ in range(4)]
    bias, w, ids = torch.zeros(E), torch.empty(4, K), torch.empty(4, K, dtype=torch.int32)
    call(x[0], bias, K, 1.0, None, "sigmoid", None, w, ids)  # makes the (CPU) ring
    ring = rec._ring
    checked = []
    real_check = rec._check_call

    def check_on_the_cpu(*args):  # the calls' own checks, against the ring's real (CPU) device
        with monkeypatch.context() as m:
            m.setattr(ring, "device", torch.device("cpu"))
            real_check(*args)

    monkeypatch.setattr(rec, "_check_call", check_on_the_cpu)
    monkeypatch.setattr(ring, "device", torch.device("cuda", 0))
    monkeypatch.setattr(ring, "launch", lambda *a: checked.append(a) or Launch())
    keyed = []  # the op's generic signature keys made (the wrapper's own key is cheaper)
    real_signature = recorder_mod.call_signature
    monkeypatch.setattr(recorder_mod, "call_signature", lambda *a: keyed.append(a) or real_signature(*a))
    for i in range(1, 5):
        call(x[i % 4], bias, K, 1.0, None, "sigmoid", None, w, ids)
    assert len(checked) == 1 and len(Launch.direct_calls) == 3  # checked once, then direct
    assert len(keyed) == 2  # the checked call, and the one that found the plan and left it under the wrapper's key
    assert [a[0] for a in Launch.direct_calls] == [x[2].data_ptr(), x[3].data_ptr(), x[0].data_ptr()]
    assert [a[-2:] for a in Launch.direct_calls] == [(-1, 0)] * 3  # by call order, site 0
    call(x[0].float(), bias, K, 1.0, None, "sigmoid", None, w, ids)  # another dtype: checked, refused
    assert len(Launch.direct_calls) == 3 and rec.error is not None and "changed dtype" in str(rec.error)
    monkeypatch.setattr(ring, "device", torch.device("cpu"))
    with pytest.raises(RouteToolError, match="changed dtype"):
        rec.close()


def _grouped_routing(gating_output, bias, topk, route_scale, router_output_multiplier=None,
                     router_score_normalization="sigmoid", router_score_division_eps=None, topk_weights=None,
                     topk_ids=None, *, is_padding=None):
    """An engine's function of the seed's signature whose model routes within 2 of 4 expert groups (its
    config's n_group / topk_group, not an argument)."""
    return musespark1x_routing_reference(gating_output, bias, topk, route_scale, router_output_multiplier,
                                         router_score_normalization, router_score_division_eps, topk_weights, topk_ids,
                                         is_padding=is_padding, n_group=4, topk_group=2)


def test_the_recorder_takes_the_router_spec_its_calls_do_not_say(fake_module, tmp_path, monkeypatch):
    from routetool.analysis.replay import replay_trace
    from routetool.engine.execution import load_kernel, select_execution
    from routetool_kernels.spec import RouterSpec

    monkeypatch.setattr(fake_module, "fused_musespark1x_routing", _grouped_routing)
    grouped = RouterSpec(num_experts=E, topk=K, route_scale=2.5, router_score_division_eps=1e-20, n_group=4,
                         topk_group=2)
    name, fn = load_kernel("routetool_kernels.reference:musespark1x_routing_reference")
    execution = select_execution(DEVICE.type).for_kernel(fn)
    found = {}
    for label, router in (("given", grouped), ("calls only", None)):
        out = tmp_path / f"{label.replace(' ', '-')}.json"
        engine = FakeEngine(fake_module, dtype=torch.float32)
        with RoutingRecorder(out, target=TARGET, num_layers=3, router=router):
            _run(engine)
        with open_trace(out) as t:
            assert t.meta.router == (grouped if router else RouterSpec(num_experts=E, topk=K, route_scale=2.5,
                                                                      router_score_division_eps=1e-20))
            result = replay_trace(t, name, fn, execution, measure_latency=False)
        found[label] = sum(layer.reference_vs_recorded.mismatch for layer in result.layers)
    # given the groups, the trace's reference reproduces the engine's routing; without them it cannot
    assert found["given"] == 0 and found["calls only"] > 0
    # a router the calls contradict stops the recording (the run goes on)
    with pytest.raises(RouteToolError, match=r"is not the router given to the recorder .*: topk differ"):
        with RoutingRecorder(tmp_path / "other.json", target=TARGET, num_layers=3,
                             router=RouterSpec(num_experts=E, topk=K + 1, route_scale=2.5,
                                               router_score_division_eps=1e-20)):
            _run(FakeEngine(fake_module, dtype=torch.float32), STEP_SIZES[:1])
    with pytest.raises(RouteToolError, match="router: n_group=5 must divide"):
        RoutingRecorder(tmp_path / "bad.json", target=TARGET, num_layers=3,
                        router=RouterSpec(num_experts=E, topk=K, n_group=5, topk_group=1))
