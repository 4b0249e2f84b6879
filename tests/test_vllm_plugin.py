"""routetool's vLLM plugin (routetool.capture.vllm_plugin) in worker processes, without vLLM.

A stand-in engine (tests/standin_engine.py) spawns 4 worker processes (torch.multiprocessing,
gloo; DP 2 x TP 2, EP 4) that load the plugin through the ``vllm.general_plugins`` entry point,
as vLLM does; each writes its own ``rank-<r>/`` sharded trace.
"""

import json
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from click.testing import CliRunner

import standin_engine
from routetool.capture import vllm_plugin
from routetool.capture.vllm_plugin import config_from_env, parse_layers
from routetool.errors import RouteToolError
from routetool.io.trace import open_trace

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINT = "routetool_capture = routetool.capture.vllm_plugin:register"


def _site(tmp_path: Path) -> Path:
    """A folder holding a distribution whose entry point is the plugin (as installing routetool
    makes one; the test environment's routetool may be installed from another checkout)."""
    site = tmp_path / "site"
    info = site / "routetool_plugin_under_test-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: routetool-plugin-under-test\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT}\n")
    return site


def test_pyproject_declares_the_entry_point():
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugins = doc["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"routetool_capture": "routetool.capture.vllm_plugin:register"}
    assert "vllm" not in " ".join(doc["project"]["dependencies"])  # never a dependency


def test_workers_each_write_their_rank(tmp_path, monkeypatch):
    run = tmp_path / "run"
    results = tmp_path / "routed"
    results.mkdir()
    for name, value in {
        "ROUTETOOL_CAPTURE_DIR": str(run),
        "ROUTETOOL_CAPTURE_TARGET": "standin_engine:fused_musespark1x_routing",
        "ROUTETOOL_CAPTURE_LAYERS": "1-3",
        "ROUTETOOL_CAPTURE_STEP_HOOK": "standin_engine:Runner.execute_model",
        "ROUTETOOL_CAPTURE_RING_MB": "1",
        "ROUTETOOL_CAPTURE_SHARD_MB": "0.002",  # several shards per rank
        "ROUTETOOL_CAPTURE_MODEL": "stand-in",
    }.items():
        monkeypatch.setenv(name, value)
    world, tp = 4, 2
    mp.spawn(standin_engine.worker, args=(world, tp, str(_site(tmp_path)), str(tmp_path / "init"), str(results)),
             nprocs=world, join=True)
    assert sorted(p.name for p in run.iterdir()) == [f"rank-{r}" for r in range(world)]
    for rank in range(world):
        index_path = run / f"rank-{rank}" / "trace.json"
        index = json.loads(index_path.read_text())
        assert index["complete"] is True and index["stopped_by"] == "exit" and len(index["shards"]) > 1
        expected_ranks = dict(rank=rank, world_size=world, dp_rank=rank // tp, dp_size=world // tp, tp_rank=rank % tp,
                              tp_size=tp, ep_rank=rank, ep_size=world, pp_rank=0, pp_size=1, source="vllm")
        assert {k: index["ranks"][k] for k in expected_ranks} == expected_ranks
        assert index["recording"]["dropped_steps"] == 0
        routed = torch.load(results / f"rank-{rank}.pt")
        with open_trace(index_path) as t:
            for key in ("rank", "world_size", "dp_rank", "tp_rank", "ep_rank", "ep_size"):
                assert t.meta.extra[key] == str(expected_ranks[key])
            assert t.meta.model == "stand-in"
            assert t.layers == standin_engine.LAYER_IDS
            # exactly the real steps (the profile run before the first step is not recorded)
            for pos, layer in enumerate(t.layers):
                steps = list(t.steps(layer))
                assert [s.num_tokens for s in steps] == [n for n, _ in standin_engine.STEPS]
                for s, step_calls in zip(steps, routed):
                    logits, pad, w, ids = step_calls[pos]
                    assert torch.equal(s.gating_output, logits) and torch.equal(s.is_padding, pad)
                    assert torch.equal(s.recorded_weights, w) and torch.equal(s.recorded_ids, ids)
    # TP peers routed the same tokens, the DP ranks others
    with open_trace(run / "rank-0" / "trace.json") as a, open_trace(run / "rank-1" / "trace.json") as b, \
            open_trace(run / "rank-2" / "trace.json") as c:
        first = [next(t.steps(1)).gating_output for t in (a, b, c)]
        assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])

    from routetool.cli import main

    res = CliRunner().invoke(main, ["replay", str(run / "rank-3" / "trace.json"), "--no-latency", "--no-progress"])
    assert res.exit_code == 0, res.output


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
    assert (c.layer_ids, c.every_n_steps, c.skip_steps, c.max_tokens, c.record_outputs, c.ring_mb, c.step_hook) == (
        (3, 5, 7), 4, 10, 100000, False, 64.0, None)
    assert config_from_env({"ROUTETOOL_CAPTURE_DIR": "x", "ROUTETOOL_CAPTURE_LAYERS": "58"}).step_hook == \
        vllm_plugin.DEFAULT_STEP_HOOK
    assert parse_layers("58") == tuple(range(58)) and parse_layers("3-60") == tuple(range(3, 61))


@pytest.mark.parametrize("extra, message", [
    ({"ROUTETOOL_CAPTURE_EVRY": "4"}, "ROUTETOOL_CAPTURE_EVRY is not a routetool capture option"),  # a typo
    ({"ROUTETOOL_CAPTURE_LAYERS": ""}, "LAYERS is not set"),
    ({"ROUTETOOL_CAPTURE_LAYERS": "60-3"}, "not a range"),
    ({"ROUTETOOL_CAPTURE_LAYERS": "1,1"}, "distinct"),
    ({"ROUTETOOL_CAPTURE_EVERY": "0"}, "EVERY='0' is not an integer >= 1"),
    ({"ROUTETOOL_CAPTURE_MAX_TOKENS": "1_000"}, "MAX_TOKENS='1_000' is not an integer"),
    ({"ROUTETOOL_CAPTURE_OUTPUTS": "yes"}, "neither 0 nor 1"),
    ({"ROUTETOOL_CAPTURE_RING_MB": "-1"}, "not a size in MiB"),
])
def test_bad_options_are_named(tmp_path, extra, message):
    env = {"ROUTETOOL_CAPTURE_DIR": str(tmp_path), "ROUTETOOL_CAPTURE_LAYERS": "4", **extra}
    with pytest.raises(RouteToolError, match=message):
        config_from_env(env)


def test_an_explicit_step_hook_must_exist(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_plugin, "_RECORDER", None)
    for name, value in {"ROUTETOOL_CAPTURE_DIR": str(tmp_path / "run"), "ROUTETOOL_CAPTURE_LAYERS": "3",
                        "ROUTETOOL_CAPTURE_TARGET": "standin_engine:fused_musespark1x_routing",
                        "ROUTETOOL_CAPTURE_STEP_HOOK": "standin_engine:Runner.no_such_method"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RouteToolError, match="STEP_HOOK=.*cannot be found"):
        vllm_plugin.register()
    assert vllm_plugin._RECORDER is None
    assert "standin_engine" in sys.modules
