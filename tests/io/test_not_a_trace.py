"""A path given where a trace is read (replay, validate, info) that is no trace is named for what
it is, with the command that reads it: one detector (routetool.io.dumps.refuse_dump_as_trace)."""

import json
import shlex

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dump_writers import routed_experts, sglang_generate, write_json, write_mcore_ep_load, write_sglang_distribution
from routetool.cli import main


def _dump(tmp_path, kind):
    if kind == "mcore-npz":
        return write_mcore_ep_load(tmp_path / "mcore_ep_loads_rank0_full.npz", np.ones((2, 3, 8), dtype=np.int32),
                                   [1, 2], [3, 3])
    if kind == "counts-json":
        return write_json(tmp_path / "counts.json", {"m": {"arxiv": {"0": {str(e): 5 + e for e in range(8)}}}})
    if kind == "sglang-stat":
        ids = torch.tensor([[[[0, 1, -1, -1, -1, -1, -1, -1]]]])
        return write_sglang_distribution(tmp_path / "sglang_stat.pt", "stat", ids, torch.arange(8)[None], [[0]])
    if kind == "sglang-per-pass":
        ids = torch.tensor([[[[0, 1, -1, -1, -1, -1, -1, -1]]]])
        return write_sglang_distribution(tmp_path / "sglang_pass.pt", "per_pass", ids, torch.arange(8)[None], [[0]])
    if kind == "sglang-generate":
        return write_json(tmp_path / "sglang_gen.json", sglang_generate(routed_experts(3, 2, 2, 8), 2))
    if kind == "replay-json":  # a JSON document that is neither counts nor an index: the index reader names it
        return write_json(tmp_path / "r.json", {"schema": "routetool.replay/1", "layers": [{"layer": 0}]})
    if kind == "markdown":
        (tmp_path / "README.md").write_text("# notes\n\nnot a trace\n")
        return tmp_path / "README.md"
    raise AssertionError(kind)


# what each is named, and the command the fix gives (it must not be one that refuses the file)
EXPECTED = {
    "mcore-npz": ("looks like a Megatron expert-load dump of per-expert counts (.npz)", "routetool balance {p}`"),
    "counts-json": ("looks like a JSON file of per-expert counts", "routetool balance {p}`"),
    "sglang-stat": ("looks like an SGLang expert-distribution dump of per-expert counts", "routetool balance {p}`"),
    "sglang-per-pass": ("looks like an SGLang expert-distribution dump of per-expert counts",
                        "routetool balance {p}`"),
    "sglang-generate": ("looks like SGLang routed experts", "routetool import {p} -o trace.safetensors --topk K`"),
    "replay-json": ("not a routetool trace index", "name a .safetensors trace"),
    "markdown": ("it does not begin with a safetensors header, so it is no routetool trace", "name a routetool trace"),
}


@pytest.mark.parametrize("kind", list(EXPECTED))
@pytest.mark.parametrize("command", [["replay", "--device", "cpu", "--no-progress"], ["info"],
                                     ["validate", "--suite", "none", "--device", "cpu", "--no-progress"]])
def test_a_path_that_is_no_trace_is_named_with_the_command_that_reads_it(tmp_path, kind, command):
    # the .npz was "not a readable safetensors file (header too large) (the file is corrupt or truncated...)",
    # counts JSON "not a routetool trace index (format=None ...)", an SGLang stat dump was sent to import, which
    # refuses counts, a /generate dump to an import without the --topk it needs, README.md called corrupt
    path = _dump(tmp_path, kind)
    res = CliRunner().invoke(main, [command[0], str(path), *command[1:]], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"routetool: error: {path}: "), res.output
    named, fix = EXPECTED[kind]
    assert named in lines[0] and fix.format(p=shlex.quote(str(path))) in lines[0], lines[0]
    assert "corrupt" not in lines[0] and "import" not in lines[0].split("(", 1)[1] or kind == "sglang-generate"


def test_the_counts_named_are_what_balance_reads(tmp_path):
    for kind in ("mcore-npz", "counts-json", "sglang-stat", "sglang-per-pass"):
        res = CliRunner().invoke(main, ["balance", str(_dump(tmp_path, kind)), "--no-progress", "--topk", "2",
                                        "--json", "-"], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["kind"] == "counts", kind
