"""`routetool balance` and `routetool import` through click's CliRunner, asserting real numbers."""

import json
import sys
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from conftest import DEVICE
from routetool.cli import _Group
from routetool.cli_balance import balance, import_
from routetool.trace import LayerArrays, RouterConfig, Trace
from tests.helpers import make_trace
from tests.test_imports import write_deepseek_like, write_mixtral_like, write_qwen_like, write_sglang_stat

REALDATA = Path(__file__).resolve().parents[2] / "shared" / "realdata"


@click.group(cls=_Group)
def cli():
    """Test group: the same RouteToolError -> exit 2 mapping as `routetool`."""


cli.add_command(balance)
cli.add_command(import_)


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _ids_trace(path):
    # layer 0: step 0 [[0,1],[0,2]], step 1 [[0,1],[2,3],[0,3]] -> counts [4,2,2,2] (see test_balance)
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 3], [0, 3]], dtype=torch.int32)
    make_trace(path, {0: LayerArrays(topk_ids=ids, step_offsets=torch.tensor([0, 2, 5]))},
               router=RouterConfig(num_experts=4, topk=2, route_scale=1.0))


def test_balance_json_numbers(tmp_path):
    trace = tmp_path / "ids.safetensors"
    _ids_trace(trace)
    out = tmp_path / "b.json"
    res = run("balance", trace, "--ep-size", "2", "--redundant", "2", "--json", out, "--no-progress")
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["schema"] == "routetool.balance/1" and d["kind"] == "trace"
    layer = d["layers"][0]
    assert layer["expert_counts_assignments"] == [4, 2, 2, 2]
    assert layer["ranks"][0]["rank_assignments"] == [6.0, 4.0]
    assert layer["ranks"][0]["balancedness_mean_over_max"] == pytest.approx(5 / 6)
    assert layer["ranks"][0]["rank_tokens_received"] == [4, 3]
    assert layer["capacity"][0]["dropped_assignments"] == 1
    assert d["eplb"]["layers"][0]["balancedness_after"] == pytest.approx(0.9375)
    assert d["eplb"]["placement"]["logical_replica_count"] == [[3, 1, 1, 1]]
    assert "no logits" in d["bias_effect_note"]
    # the report names the numbers too
    assert "0.833" in res.output and "0.938" in res.output and "EPLB what-if (global)" in res.output


def test_balance_json_to_stdout_keeps_tables_off_stdout(tmp_path):
    trace = tmp_path / "ids.safetensors"
    _ids_trace(trace)
    try:  # click < 8.2 mixes stderr into stdout unless told not to; 8.2+ keeps them apart
        runner = CliRunner(mix_stderr=False)
    except TypeError:
        runner = CliRunner()
    res = runner.invoke(cli, ["balance", str(trace), "--ep-size", "2", "--json", "-", "--no-progress"])
    assert res.exit_code == 0
    d = json.loads(res.stdout)
    assert d["layers"][0]["load"]["imbalance_max_over_mean"] == pytest.approx(1.6)


def test_eplb_out_then_placement_reproduces_after(tmp_path):
    trace = tmp_path / "ids.safetensors"
    _ids_trace(trace)
    placement = tmp_path / "placement.json"
    out = tmp_path / "b.json"
    assert run("balance", trace, "--ep-size", "2", "--redundant", "2", "--eplb-out", placement,
               "--no-progress").exit_code == 0
    doc = json.loads(placement.read_text())
    assert doc["schema"] == "routetool.placement/1" and doc["num_gpus"] == 2 and doc["layers"] == [0]
    res = run("balance", trace, "--ep-size", "2", "--placement", placement, "--no-eplb", "--json", out, "--no-progress")
    assert res.exit_code == 0, res.output
    ranks = json.loads(out.read_text())["layers"][0]["ranks"]
    assert ranks[1]["placement"] == "placement.json ep=2"
    assert ranks[1]["balancedness_mean_over_max"] == pytest.approx(0.9375)
    assert ranks[1]["rank_tokens_received"] is None  # replicas: distinct tokens per rank undefined


def test_outputs_are_not_overwritten_without_force(tmp_path):
    trace = tmp_path / "ids.safetensors"
    _ids_trace(trace)
    out = tmp_path / "b.json"
    out.write_text("keep")
    res = run("balance", trace, "--ep-size", "2", "--json", out, "--no-progress")
    assert res.exit_code == 2 and "already exists" in res.output and out.read_text() == "keep"
    assert run("balance", trace, "--ep-size", "2", "--json", out, "--force", "--no-progress").exit_code == 0
    assert json.loads(out.read_text())["schema"] == "routetool.balance/1"


@pytest.mark.parametrize("args, words", [
    (["--ep-size", "3"], "cannot be split evenly over 3 EP ranks"),
    (["--ep-size", "x"], "is not a list of integers"),
    (["--ep-size", "2", "--redundant", "1"], "multiple of the 2 GPUs"),
    (["--reference", "--recorded"], "exclude each other"),
    (["--reference"], "ids-only trace"),
    (["--layers", "9"], "no layer 9"),
    (["--layer", "3"], "not among the analysed layers"),
    (["--capacity-factor", "0"], "factors must be > 0"),
])
def test_bad_usage_is_one_line_exit_2(tmp_path, args, words):
    trace = tmp_path / "ids.safetensors"
    _ids_trace(trace)
    res = run("balance", trace, *args, "--no-progress")
    assert res.exit_code == 2, res.output
    assert res.output.startswith("routetool: error:") and words in res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_balance_on_dumps_directly(tmp_path):
    q = tmp_path / "q.jsonl"
    write_qwen_like(q)
    out = tmp_path / "q.json"
    res = run("balance", q, "--num-experts", "16", "--ep-size", "4", "--json", out, "--no-progress")
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["kind"] == "ids" and d["layers"][0]["tokens"] == 8 and d["num_experts"] == 16
    assert any("dropped 170 warm-up/dummy rows" in n for n in d["notes"])
    assert "dropped 170 warm-up/dummy rows" in res.output
    assert "not available: an imported dump holds expert ids" in res.output
    folder = tmp_path / "ds"
    write_deepseek_like(folder)
    res = run("balance", folder, "--ep-size", "8", "--json", tmp_path / "ds.json", "--no-progress")
    assert res.exit_code == 0, res.output
    assert [x["layer"] for x in json.loads((tmp_path / "ds.json").read_text())["layers"]] == [1, 2]
    pt = tmp_path / "stat.pt"
    write_sglang_stat(pt)
    res = run("balance", pt, "--ep-size", "2", "--json", tmp_path / "s.json", "--no-progress")
    assert res.exit_code == 0, res.output
    d = json.loads((tmp_path / "s.json").read_text())
    assert d["kind"] == "counts" and [x["num_steps"] for x in d["layers"]] == [3, 3]
    # layer 1: [4,0,1,1,0,0,1,1] + [0,0,0,0,2,2,2,2] + [1]*8 (the empty buffer slot ignored)
    assert d["layers"][0]["expert_counts_assignments"] == [5, 1, 2, 2, 3, 3, 4, 4]


def test_kernel_routing_default_on_a_trace_with_logits(tmp_path):
    # the default routes logits with the project's kernel (compiled, or the Triton interpreter on CPU)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(24, 8, generator=g)
    bias = torch.zeros(8)
    bias[0] = 5.0  # a large bias pins expert 0 into every token's top-2
    trace = tmp_path / "t.safetensors"
    make_trace(trace, {0: LayerArrays(gating_output=logits, bias=bias, step_offsets=torch.tensor([0, 16, 24]))})
    out = tmp_path / "k.json"
    res = run("balance", trace, "--ep-size", "2", "--json", out, "--no-progress", "--device", DEVICE.type)
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["routing"].startswith("kernel tiled")
    layer = d["layers"][0]
    assert layer["expert_counts_assignments"][0] == 24  # every token picks the biased expert
    b = layer["bias_effect"]
    assert b["expert_counts_with_bias_assignments"][0] == 24
    assert b["expert_counts_bias_zeroed_assignments"][0] < 24
    assert b["load_bias_zeroed"]["imbalance_max_over_mean"] < b["load_with_bias"]["imbalance_max_over_mean"]


def test_plots_written_and_protected(tmp_path):
    pytest.importorskip("matplotlib")
    trace = tmp_path / "ids.safetensors"
    _ids_trace(trace)
    plots = tmp_path / "figs"
    res = run("balance", trace, "--ep-size", "2", "--plot", plots, "--no-progress")
    assert res.exit_code == 0, res.output
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["balancedness_eplb.png", "expert_load_heatmap.png", "rank_load.png"]
    assert all((plots / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    res = run("balance", trace, "--ep-size", "2", "--plot", plots, "--no-progress")
    assert res.exit_code == 2 and "pass --force" in res.output


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    trace = tmp_path / "ids.safetensors"
    _ids_trace(trace)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    res = run("balance", trace, "--ep-size", "2", "--plot", tmp_path / "figs", "--no-progress")
    assert res.exit_code == 2 and "pip install routetool[plot]" in res.output


def test_import_writes_a_trace_balance_reads(tmp_path):
    src = tmp_path / "m.jsonl"
    write_mixtral_like(src)
    out = tmp_path / "m.safetensors"
    res = run("import", src, "-o", out)
    assert res.exit_code == 0, res.output
    assert "wrote" in res.output
    with Trace(out) as t:
        assert t.layers == (0, 1) and not t.info(0).has_logits
    res = run("import", src, "-o", out)
    assert res.exit_code == 2 and "already exists" in res.output
    js = tmp_path / "m.json"
    assert run("balance", out, "--ep-size", "2", "--json", js, "--no-progress").exit_code == 0
    d = json.loads(js.read_text())
    assert d["layers"][0]["expert_counts_assignments"] == [0, 0, 0, 2, 0, 5, 2, 1]


def test_import_refuses_counts(tmp_path):
    pt = tmp_path / "stat.pt"
    write_sglang_stat(pt)
    res = run("import", pt, "-o", tmp_path / "x.safetensors")
    assert res.exit_code == 2 and "holds per-expert counts" in res.output and "routetool balance" in res.output
    assert not (tmp_path / "x.safetensors").exists()


def test_import_bad_file_is_exit_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"topk_ids": [1, 2]}\n{oops\n')
    res = run("import", bad, "-o", tmp_path / "x.safetensors")
    assert res.exit_code == 2 and "bad.jsonl: line 2: not JSON" in res.output


@pytest.mark.skipif(not REALDATA.is_dir(), reason="../shared/realdata not present")
def test_real_deepseek_folder_through_the_cli(tmp_path):
    out = tmp_path / "ds.json"
    res = run("balance", REALDATA / "deepseek-v2-lite-expert-ids", "--json", out, "--no-progress")
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert len(d["layers"]) == 26 and d["ep"][0]["num_ranks"] == 8
    before, after = d["eplb"]["balancedness_before"]["mean"], d["eplb"]["balancedness_after"]["mean"]
    assert 0.7 < before < 0.9 and after > 0.97


def test_sharded_trace_index_is_read_as_one_trace(tmp_path):
    pytest.importorskip("routetool.sharded")
    router = RouterConfig(num_experts=4, topk=2, route_scale=1.0)
    make_trace(tmp_path / "run-00000.safetensors",
               {0: LayerArrays(topk_ids=torch.tensor([[0, 1], [0, 2]], dtype=torch.int32))}, router=router)
    make_trace(tmp_path / "run-00001.safetensors",
               {0: LayerArrays(topk_ids=torch.tensor([[0, 1], [2, 3], [0, 3]], dtype=torch.int32))}, router=router)
    index = tmp_path / "run.json"
    index.write_text(json.dumps({"format": "routetool-trace-index", "version": "1", "complete": True,
                                 "shards": [{"path": "run-00000.safetensors"}, {"path": "run-00001.safetensors"}]}))
    out = tmp_path / "b.json"
    res = run("balance", index, "--ep-size", "2", "--json", out, "--no-progress")
    assert res.exit_code == 0, res.output
    layer = json.loads(out.read_text())["layers"][0]
    assert layer["expert_counts_assignments"] == [4, 2, 2, 2] and layer["num_steps"] == 2
    assert layer["ranks"][0]["balancedness_mean_over_max"] == pytest.approx(5 / 6)


def test_layer_detail_shows_the_eplb_placement(tmp_path):
    # counts [4,2,2,2], 2 GPUs, 2 redundant: e0 gets 3 replicas; packing (see test_balance) puts
    # slots {e1, e3, e0} on GPU 0 (5.33) and {e2, e0, e0} on GPU 1 (4.67)
    trace = tmp_path / "ids.safetensors"
    _ids_trace(trace)
    res = CliRunner().invoke(cli, ["balance", str(trace), "--ep-size", "2", "--redundant", "2", "--layer", "0",
                                   "--no-progress"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "EPLB placement of layer 0" in res.output
    lines = [ln for ln in res.output.splitlines() if "0×3" in ln]
    assert any("1, 3, 0×3" in ln and "5.3" in ln for ln in lines)
    assert any("2, 0×3, 0×3" in ln and "4.7" in ln for ln in lines)
    assert "Windows of layer 0" in res.output
