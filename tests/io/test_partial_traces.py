"""A trace that holds less than a whole recording (a recording cut short: its index not
``"complete": true``; or layers with unequal steps) is said to be so first, by every command that
reads it, in the terminal and in the JSON (docs/cli-contract.md, "Partial traces")."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from routetool.cli import main
from routetool.io.trace import LayerArrays, RouterConfig

E, K = 8, 2
ROUTER = RouterConfig(num_experts=E, topk=K, route_scale=1.0)


def _layer(gen, sizes):
    T = sum(sizes)
    return LayerArrays(gating_output=torch.randn((T, E), generator=gen), bias=torch.zeros(E),
                       step_offsets=torch.tensor([0, *sizes]).cumsum(0))


@pytest.fixture
def cut_short(make_sharded):
    """A sharded recording killed after two shards of 2 steps each: the recorder's index says
    ``"complete": false`` and names no reason (``stopped_by`` null), as after a SIGKILL."""
    gen = torch.Generator().manual_seed(0)
    shards = [{0: _layer(gen, [5, 3]), 1: _layer(gen, [5, 3])} for _ in range(2)]
    return make_sharded("run.json", shards, ROUTER, complete=False, stopped_by=None)


@pytest.fixture
def unequal(make_trace):
    """One file whose last step was cut short inside the model: layer 0 holds 3 steps, layer 1 two."""
    gen = torch.Generator().manual_seed(1)
    return make_trace("t.safetensors", {0: _layer(gen, [4, 4, 4]), 1: _layer(gen, [4, 4])}, router=ROUTER)


COMMANDS = {
    "replay": ["replay", "--no-latency", "--no-progress", "--device", "cpu"],
    "validate": ["validate", "--suite", "none", "--no-progress", "--device", "cpu"],
    "balance": ["balance", "--no-progress", "--device", "cpu"],
    "info": ["info", "--no-progress"],  # (a trace of unequal steps: its layout line said "one file" and no more)
}


def _run(command, trace, tmp_path):
    out = tmp_path / f"{command}.json"
    args = COMMANDS[command]
    res = CliRunner().invoke(main, [args[0], str(trace), *args[1:], "--json", str(out)])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res, json.loads(out.read_text())


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_recording_cut_short_is_said_first_and_in_the_json(tmp_path, cut_short, command):
    # replay and balance passed on a killed recording without a word (only info said it)
    index = cut_short
    res, doc = _run(command, index, tmp_path)
    assert res.exit_code == 0, res.output
    first = res.stdout.splitlines()[0]
    assert first == (f"INCOMPLETE TRACE: {index}: the recording did not finish (index \"complete\": false; stopped "
                     "by: unknown: killed, or still recording); steps present: 4 steps (layers 0-1); the report "
                     "covers these steps only"), res.stdout[:500]
    assert doc["complete"] is False
    assert doc["partial"] == [{"trace": str(index), "rank": None, "why": first.split(": ", 2)[2].split("; steps")[0],
                               "index_complete": False, "stopped_by": None, "unequal_steps": False,
                               "steps": {"0": 4, "1": 4}}]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_layers_with_unequal_steps_are_said_first_and_in_the_json(tmp_path, unequal, command):
    trace = unequal
    res, doc = _run(command, trace, tmp_path)
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0] == (
        f"INCOMPLETE TRACE: {trace}: its layers hold unequal steps (a step cut short inside the model); steps "
        "present: 3 steps (layer 0), 2 (layer 1); the report covers these steps only"), res.stdout[:500]
    assert doc["complete"] is False and doc["partial"][0]["steps"] == {"0": 3, "1": 2}
    assert doc["partial"][0]["unequal_steps"] is True and doc["partial"][0]["index_complete"] is None


def test_a_run_folder_names_its_partial_rank(tmp_path, make_sharded, make_trace):
    gen = torch.Generator().manual_seed(2)
    for r in range(2):
        (tmp_path / "run" / f"rank-{r}").mkdir(parents=True)
    make_trace("run/rank-0/t.safetensors", {0: _layer(gen, [4, 4])}, router=ROUTER, rank="0", world_size="2")
    index = make_sharded("run/rank-1/run.json", [{0: _layer(gen, [4])}], ROUTER, complete=False,
                         stopped_by="error: out of disk space", rank="1", world_size="2")
    res, doc = _run("replay", tmp_path / "run", tmp_path)
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].startswith(f"INCOMPLETE TRACE: rank-1 {index}: the recording did not finish "
                                                 "(index \"complete\": false; stopped by: error: out of disk space)")
    assert doc["complete"] is False and [p["rank"] for p in doc["partial"]] == [1]


def test_a_whole_trace_says_nothing_of_the_kind(tmp_path, make_trace):
    gen = torch.Generator().manual_seed(3)
    trace = make_trace("t.safetensors", {0: _layer(gen, [4, 4]), 1: _layer(gen, [4, 4])}, router=ROUTER)
    for command in COMMANDS:
        res, doc = _run(command, trace, tmp_path)
        assert "INCOMPLETE" not in res.output
        assert doc["complete"] is True and doc["partial"] == []
