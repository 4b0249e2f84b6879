"""routetool's vLLM plugin (routetool.capture.vllm_plugin), driven as vLLM 0.33 drives it, without vLLM.

The engine is a stand-in with vLLM 0.33.0's module layout and import order
(tests/fixtures/vllm033, driven by tests/standin_engine.py): the plugin loads first, then the
model package (whose ``__init__`` imports both call sites, each from-importing the routing
function), then the profile run and the steps. Nothing names the routing function or the step
hook: the plugin's defaults must find them.
"""

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from click.testing import CliRunner

import standin_engine
from routetool.capture import vllm_plugin
from routetool.capture.binding import WATCHER
from routetool.capture.vllm_plugin import MAX_LAYERS, config_from_env, parse_layers
from routetool.errors import RouteToolError
from routetool.io.trace import open_trace

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINT = "routetool_capture = routetool.capture.vllm_plugin:register"
ROUTING = "vllm.models.muse_spark.common.ops.fused_routing"
BOTH_CALL_SITES = {f"{module}.fused_musespark1x_routing" for module in (
    ROUTING, "vllm.models.muse_spark.common.moe", "vllm.models.muse_spark.nvidia.model")}  # defining module + 2 callers
MEGA_MOE_LAYER = 2  # the fixture's layer that routes through the MegaMoE route() (caller buffers, is_padding)


def _site(tmp_path: Path) -> Path:
    """A folder holding a distribution whose entry point is the plugin (as installing routetool
    makes one; the test environment's routetool may be installed from another checkout)."""
    site = tmp_path / "site"
    info = site / "routetool_plugin_under_test-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: routetool-plugin-under-test\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT}\n")
    return site


@pytest.fixture
def engine(tmp_path, monkeypatch):
    """The stand-in vLLM importable in this process, the plugin unloaded; afterwards the stand-in
    is forgotten (no test after this one can import ``vllm``) and any recording stopped."""
    monkeypatch.syspath_prepend(str(standin_engine.FIXTURE))
    monkeypatch.syspath_prepend(str(_site(tmp_path)))
    monkeypatch.setattr(vllm_plugin, "_RECORDER", None)
    monkeypatch.setattr(vllm_plugin, "_SESSION", None)
    for name in [n for n in sys.modules if n.startswith(vllm_plugin.PREFIX) or n.startswith("vllm.")] + ["vllm"]:
        sys.modules.pop(name, None)
    for name in [k for k in list(os.environ) if k.startswith(vllm_plugin.PREFIX)]:
        monkeypatch.delenv(name)
    yield
    vllm_plugin.stop()
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        sys.modules.pop(name, None)
    assert WATCHER not in sys.meta_path


def _env(monkeypatch, run: Path, **extra):
    for name, value in {"ROUTETOOL_CAPTURE_DIR": str(run), "ROUTETOOL_CAPTURE_LAYERS": "1-3", **extra}.items():
        monkeypatch.setenv(name if name.startswith("ROUTETOOL_") else f"ROUTETOOL_CAPTURE_{name}", value)


def _check_rank(index_path: Path, routed: list[list[tuple]], model: str | None = None) -> None:
    """Every call of every real step recorded, from both call sites, as the engine routed it."""
    index = json.loads(index_path.read_text())
    assert index["complete"] is True and index["stopped_by"] == "exit"
    rec = index["recording"]
    assert set(rec["bindings"]) == BOTH_CALL_SITES
    assert rec["model_steps"] == len(standin_engine.STEPS) and rec["dropped_steps"] == 0
    with open_trace(index_path) as t:
        if model is not None:
            assert t.meta.model == model
        assert t.layers == standin_engine.LAYER_IDS
        assert len(routed) == len(standin_engine.STEPS)
        for pos, layer in enumerate(t.layers):
            steps = list(t.steps(layer))
            # exactly the real steps (the profile run before the first step is not recorded)
            assert [s.num_tokens for s in steps] == [n for n, _ in standin_engine.STEPS]
            for s, step_calls in zip(steps, routed):
                logits, pad, w, ids = step_calls[pos]
                assert torch.equal(s.gating_output, logits)
                assert torch.equal(s.recorded_weights, w) and torch.equal(s.recorded_ids, ids)
                if layer == MEGA_MOE_LAYER:  # the MegaMoE call passes is_padding
                    assert torch.equal(s.is_padding, pad)
                else:  # the router's call passes none: its rows are unpadded
                    assert s.is_padding is None or not s.is_padding.any()


def test_pyproject_declares_the_entry_point():
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugins = doc["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"routetool_capture": "routetool.capture.vllm_plugin:register"}
    assert "vllm" not in " ".join(doc["project"]["dependencies"])  # never a dependency


def test_workers_each_write_their_rank(tmp_path, monkeypatch):
    """4 worker processes (DP 2 x TP 2, EP 4), model runner V2 (vLLM 0.33's default), the
    default target and step hooks: every rank records every step from both call sites."""
    run = tmp_path / "run"
    results = tmp_path / "routed"
    results.mkdir()
    for name in [k for k in list(os.environ) if k.startswith(vllm_plugin.PREFIX)]:
        monkeypatch.delenv(name)
    _env(monkeypatch, run, RING_MB="1", SHARD_MB="0.002", MODEL="stand-in")  # several shards per rank
    world, tp = 4, 2
    mp.spawn(standin_engine.worker, args=(world, tp, str(_site(tmp_path)), str(tmp_path / "init"), str(results)),
             nprocs=world, join=True)
    assert sorted(p.name for p in run.iterdir()) == [f"rank-{r}" for r in range(world)]
    for rank in range(world):
        index_path = run / f"rank-{rank}" / "trace.json"
        assert len(json.loads(index_path.read_text())["shards"]) > 1
        expected_ranks = {"rank": rank, "world_size": world, "dp_rank": rank // tp, "tp_rank": rank % tp,
                          "ep_rank": rank, "ep_size": world}
        _check_rank(index_path, torch.load(results / f"rank-{rank}.pt"), model="stand-in")
        with open_trace(index_path) as t:
            for key, value in expected_ranks.items():
                assert t.meta.extra[key] == str(value)
    # TP peers routed the same tokens, the DP ranks others
    with open_trace(run / "rank-0" / "trace.json") as a, open_trace(run / "rank-1" / "trace.json") as b, \
            open_trace(run / "rank-2" / "trace.json") as c:
        first = [next(t.steps(1)).gating_output for t in (a, b, c)]
        assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])

    from routetool.cli import main

    res = CliRunner().invoke(main, ["replay", str(run / "rank-3" / "trace.json"), "--no-latency", "--no-progress"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("runner, model_first", [
    ("1", False),  # model runner V2 (the default), plugin before the model: vLLM's order
    ("0", False),  # model runner V1 (VLLM_USE_V2_MODEL_RUNNER=0): the other step hook
    ("1", True),   # the model package imported before the plugin loads: found by the scan at start
], ids=["v2", "v1", "model-imported-first"])
def test_every_call_of_every_step_is_recorded(engine, tmp_path, monkeypatch, capsys, runner, model_first):
    run = tmp_path / "run"
    _env(monkeypatch, run)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
    routed = standin_engine.run_worker(0, 1, 1, model_first=model_first)
    module = sys.modules[ROUTING]
    assert module.fused_musespark1x_routing.__routetool_recorder__ is vllm_plugin._RECORDER
    vllm_plugin.stop()
    assert not hasattr(module.fused_musespark1x_routing, "__routetool_recorder__")  # every binding restored
    for name in ("vllm.models.muse_spark.common.moe", "vllm.models.muse_spark.nvidia.model"):
        assert sys.modules[name].fused_musespark1x_routing is module.fused_musespark1x_routing
    _check_rank(run / "rank-0" / "trace.json", routed)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("routetool: recording vllm.models.muse_spark.common.ops.fused_routing:")
    assert err[-1].startswith(f"routetool: {run}/rank-0/trace.json: recorded 4 steps (")
    assert "3 bindings: " in err[-1] and len(err) == 2


@pytest.mark.parametrize("target, said", [
    # a module the engine never imports (on ROCm vLLM routes elsewhere)
    ("vllm.models.muse_spark.amd.ops.router:fused_musespark1x_routing",
     "0 bindings; never imported: vllm.models.muse_spark.amd.ops.router:fused_musespark1x_routing"),
    # a function with the seed's signature that is bound, but that the model never calls
    ("standin_engine:fused_musespark1x_routing", "binding"),
], ids=["never-imported", "never-called"])
def test_a_target_that_is_never_called_says_so(engine, tmp_path, monkeypatch, capsys, target, said):
    """The old failure (the engine routes, the recorder sees nothing) cannot end as an empty
    success: a warning at exit, and a "recorded: nothing" record that info reads as such."""
    run = tmp_path / "run"
    _env(monkeypatch, run, TARGET=target)
    standin_engine.run_worker(0, 1, 1)
    vllm_plugin.stop()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[1].startswith("routetool: warning: ") and "recorded nothing: 4 model steps" in err[1]
    assert said in err[1]
    index = json.loads((run / "rank-0" / "trace.json").read_text())
    assert index["recorded"] == "nothing" and index["shards"] == [] and index["recording"]["model_steps"] == 4
    from routetool.cli import main

    res = CliRunner().invoke(main, ["info", str(run)])
    assert res.exit_code == 2 and "recorded nothing: 4 model steps" in res.output, res.output


def test_a_process_that_never_steps_stays_silent(engine, tmp_path, monkeypatch, capsys):
    """The API server and the engine core load the plugin too, and never run the model."""
    run = tmp_path / "run"
    _env(monkeypatch, run)
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert vllm_plugin._RECORDER is not None
    vllm_plugin.stop()
    assert capsys.readouterr().err.count("\n") == 1  # the "recording ..." line only
    assert list(run.iterdir()) == []


def test_register_does_nothing_without_the_folder(monkeypatch):
    monkeypatch.delenv("ROUTETOOL_CAPTURE_DIR", raising=False)
    monkeypatch.setattr(vllm_plugin, "_RECORDER", None)
    vllm_plugin.register()
    assert vllm_plugin._RECORDER is None
    assert config_from_env({"ROUTETOOL_CAPTURE_DIR": "", "ROUTETOOL_CAPTURE_LAYERS": "x"}) is None


def test_options_from_env(tmp_path):
    env = {"ROUTETOOL_CAPTURE_DIR": str(tmp_path), "ROUTETOOL_CAPTURE_LAYERS": "3,5,7", "ROUTETOOL_CAPTURE_EVERY": "4",
           "ROUTETOOL_CAPTURE_SKIP": "10", "ROUTETOOL_CAPTURE_MAX_TOKENS": "100000", "ROUTETOOL_CAPTURE_OUTPUTS": "0",
           "ROUTETOOL_CAPTURE_RING_MB": "64", "ROUTETOOL_CAPTURE_STEP_HOOK": "none"}
    c = config_from_env(env)
    assert (c.layer_ids, c.every_n_steps, c.skip_steps, c.max_tokens, c.record_outputs, c.ring_mb, c.step_hooks) == (
        (3, 5, 7), 4, 10, 100000, False, 64.0, ())
    default = config_from_env({"ROUTETOOL_CAPTURE_DIR": "x", "ROUTETOOL_CAPTURE_LAYERS": "58"})
    assert default.step_hooks == vllm_plugin.DEFAULT_STEP_HOOKS and default.target is None
    assert parse_layers("58") == tuple(range(58)) and parse_layers("3-60") == tuple(range(3, 61))
    assert len(parse_layers(f"0-{MAX_LAYERS - 1}")) == MAX_LAYERS


@pytest.mark.parametrize("extra, message", [
    ({"ROUTETOOL_CAPTURE_EVRY": "4"}, "ROUTETOOL_CAPTURE_EVRY is not a routetool capture option"),  # a typo
    ({"ROUTETOOL_CAPTURE_LAYERS": ""}, "LAYERS is not set"),
    ({"ROUTETOOL_CAPTURE_LAYERS": "60-3"}, "not a range"),
    ({"ROUTETOOL_CAPTURE_LAYERS": "1,1"}, "distinct"),
    # a range of a billion layers was allocated (and raised a traceback) before it was refused
    ({"ROUTETOOL_CAPTURE_LAYERS": "0-1000000000"}, "names 1000000001 MoE layers per step, more than 1024"),
    ({"ROUTETOOL_CAPTURE_LAYERS": "100000"}, "names 100000 MoE layers"),
    ({"ROUTETOOL_CAPTURE_LAYERS": ",".join(map(str, range(2000)))}, "names 2000 MoE layers"),
    ({"ROUTETOOL_CAPTURE_EVERY": "0"}, "EVERY='0' is not an integer from 1"),
    ({"ROUTETOOL_CAPTURE_EVERY": "9" * 30}, "is not an integer from 1 to 2\\*\\*62"),  # past a device int64
    ({"ROUTETOOL_CAPTURE_MAX_TOKENS": "1_000"}, "MAX_TOKENS='1_000' is not an integer"),
    ({"ROUTETOOL_CAPTURE_OUTPUTS": "yes"}, "neither 0 nor 1"),
    ({"ROUTETOOL_CAPTURE_RING_MB": "-1"}, "not a size in MiB"),
    ({"ROUTETOOL_CAPTURE_RING_MB": "1e309"}, "not a size in MiB"),
    # {rank} in the run folder was filled in, and the folder named stayed empty
    ({"ROUTETOOL_CAPTURE_DIR": "/tmp/run-{rank}"}, "holds {rank}: the plugin makes the rank-<r> folders"),
])
def test_bad_options_are_named(tmp_path, extra, message):
    env = {"ROUTETOOL_CAPTURE_DIR": str(tmp_path), "ROUTETOOL_CAPTURE_LAYERS": "4", **extra}
    with pytest.raises(RouteToolError, match=message):
        config_from_env(env)


@pytest.mark.parametrize("extra, said", [
    ({"LAYERS": "0-1000000000"}, "ROUTETOOL_CAPTURE_LAYERS='0-1000000000' names 1000000001 MoE layers"),
    ({"DIR": "{tmp}/run-{{rank}}"}, "holds {rank}"),
    ({"DIR": "{tmp}/no\nsuch/run\x1b[2J"}, "no\\nsuch/run\\x1b[2J: cannot make the run folder"),  # escaped
    ({"STEP_HOOK": "vllm.v1.worker.gpu_model_runner:GPUModelRunner.no_such_method"}, "STEP_HOOK=.*cannot be found"),
], ids=["layers", "rank-in-dir", "control-chars", "step-hook"])
def test_bad_options_never_stop_the_engine(engine, tmp_path, monkeypatch, capsys, extra, said):
    """vLLM's load_general_plugins lets a plugin's exception end the process: the plugin prints
    one line instead, and this process records nothing."""
    _env(monkeypatch, tmp_path / "run", **{k: v.replace("{tmp}", str(tmp_path)).replace("{{rank}}", "{rank}")
                                           for k, v in extra.items()})
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # no exception
    assert vllm_plugin._RECORDER is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("routetool: ") and "\x1b" not in err
    assert re.search(said if "*" in said else re.escape(said), err), err
    assert err.rstrip("\n").endswith("recording is off in this process (pid %d)" % os.getpid())
    assert WATCHER not in sys.meta_path


def test_a_run_folder_with_control_characters_is_named_escaped(engine, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run\nnext"
    _env(monkeypatch, run)
    standin_engine.run_worker(0, 1, 1)
    vllm_plugin.stop()
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "run\\nnext" in err  # two lines, the newline escaped
    assert (run / "rank-0" / "trace.json").is_file()


def test_a_recorder_failure_at_a_step_never_reaches_the_engine(engine, tmp_path, monkeypatch, capsys):
    from routetool.capture.recorder import RoutingRecorder

    def broken_step(self, **kwargs):
        raise RuntimeError("simulated device error while draining")

    _env(monkeypatch, tmp_path / "run")
    monkeypatch.setattr(RoutingRecorder, "step", broken_step)
    routed = standin_engine.run_worker(0, 1, 1)  # every step runs
    assert len(routed) == len(standin_engine.STEPS)
    err = capsys.readouterr().err.splitlines()
    assert sum("recording failed at a model step (RuntimeError: simulated" in line for line in err) == 1


def test_a_worker_forked_after_the_plugin_loaded_records_and_ends(tmp_path, monkeypatch):
    """vLLM forks its workers from the engine core (VLLM_WORKER_MULTIPROC_METHOD=fork, the
    default), which loaded the plugins: the worker's session is the inherited one, and the
    worker ends with os._exit (no atexit): the recording is finished all the same."""
    run = tmp_path / "run"
    for name in [k for k in list(os.environ) if k.startswith(vllm_plugin.PREFIX)]:
        monkeypatch.delenv(name)
    _env(monkeypatch, run)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    code = f"import standin_engine; standin_engine.forked_worker({str(_site(tmp_path))!r}, {str(tmp_path / 'r.pt')!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    _check_rank(run / "rank-0" / "trace.json", torch.load(tmp_path / "r.pt"))
    err = proc.stderr.splitlines()
    assert len(err) == 2 and err[1].startswith(f"routetool: {run}/rank-0/trace.json: recorded 4 steps"), err
