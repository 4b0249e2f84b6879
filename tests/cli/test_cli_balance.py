"""`routetool balance` and `routetool import` through click's CliRunner, asserting real numbers."""

import json
import os
import sys
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from conftest import DEVICE
from routetool.cli import _Group
from routetool.cli.balance import balance, import_
from routetool.io.trace import LayerArrays, RouterConfig, Trace
from tests.io.test_imports import (
    write_deepseek_like,
    write_mixtral_like,
    write_qwen_like,
    write_sglang_per_token,
    write_sglang_stat,
)

REALDATA = Path(__file__).resolve().parents[3] / "shared" / "realdata"


@click.group(cls=_Group)
def cli():
    """Test group: the same RouteToolError -> exit 2 mapping as `routetool`."""


cli.add_command(balance)
cli.add_command(import_)


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def ids_trace(make_trace):
    """``ids.safetensors``: an ids-only trace of one layer, 2 steps, E=4, K=2."""
    # layer 0: step 0 [[0,1],[0,2]], step 1 [[0,1],[2,3],[0,3]] -> counts [4,2,2,2] (see test_balance)
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 3], [0, 3]], dtype=torch.int32)
    return make_trace("ids.safetensors", {0: LayerArrays(topk_ids=ids, step_offsets=torch.tensor([0, 2, 5]))},
                      router=RouterConfig(num_experts=4, topk=2, route_scale=1.0))


def test_balance_json_numbers(tmp_path, ids_trace):
    trace = ids_trace
    out = tmp_path / "b.json"
    res = run("balance", "--details", trace, "--ep-size", "2", "--redundant", "2", "--json", out, "--no-progress")
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


def test_balance_json_to_stdout_keeps_tables_off_stdout(ids_trace):
    trace = ids_trace
    try:  # click < 8.2 mixes stderr into stdout unless told not to; 8.2+ keeps them apart
        runner = CliRunner(mix_stderr=False)
    except TypeError:
        runner = CliRunner()
    res = runner.invoke(cli, ["balance", str(trace), "--ep-size", "2", "--json", "-", "--no-progress"])
    assert res.exit_code == 0
    d = json.loads(res.stdout)
    assert d["layers"][0]["load"]["imbalance_max_over_mean"] == pytest.approx(1.6)


def test_eplb_out_then_placement_reproduces_after(tmp_path, ids_trace):
    trace = ids_trace
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


def test_outputs_are_not_overwritten_without_force(tmp_path, ids_trace):
    trace = ids_trace
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
    # ran (nearly) forever, one slot at a time; refused before the trace is read
    (["--ep-size", "2", "--redundant", "100000000"], "EPLB: --redundant 100000000 is over the limit of 12 redundant "
                                                      "experts (3 per logical expert, 4 experts) (pass --redundant 12 "
                                                      "or fewer"),
    (["--gpus", "4", "--redundant", "99999996"], "--redundant 99999996 is over the limit of 12"),
    # --gpus alone named --redundant, which the user never gave (its default is one per GPU)
    (["--gpus", "1000"], "routetool: error: EPLB: --gpus 1000 implies --redundant 1000 by default (one redundant "
                         "expert per GPU), over the limit of 12 redundant experts (3 per logical expert, 4 experts) "
                         "(pass fewer --gpus, or an explicit --redundant of at most 12)"),
    (["--reference", "--recorded"], "exclude each other"),
    (["--reference"], "ids-only trace"),
    # an explicit --kernel on an ids-only trace was ignored (the recorded ids were used)
    (["--kernel", "seed"], ("layers.0.gating_output: holds no gating_output (an ids-only trace): cannot route with "
                            "the kernel (drop --reference/--kernel")),
    (["--layers", "9"], "no layer 9"),
    (["--layer", "3"], "not among the analysed layers"),
    (["--capacity-factor", "0"], "factors must be > 0"),
    # an empty item was dropped silently (8,,16 ran as 8,16), unlike synth's --prefill 8,,8
    (["--ep-size", "2,,4"], "--ep-size '2,,4' has an empty item (separate the values with single commas, e.g. "
                            "--ep-size 8,16)"),
    (["--ep-size", "2,"], "--ep-size '2,' has an empty item"),
    (["--ep-size", ",2"], "--ep-size ',2' has an empty item"),
    # a repeat was simulated and reported twice (bench refuses repeats in its lists)
    (["--ep-size", "2,2"], "routetool: error: --ep-size '2,2' names 2 twice (name each value once)"),
    (["--ep-size", "1,2,02"], "--ep-size '1,2,02' names 2 twice"),
    (["--capacity-factor", "1.0,1"], "--capacity-factor '1.0,1' names 1.0 twice (name each value once)"),
    (["--capacity-factor", "1.0,,2"], "--capacity-factor '1.0,,2' has an empty item (separate the values with "
                                      "single commas, e.g. --capacity-factor 1.0,1.25,2)"),
    # int()/float() read "1_6" as 16 and "1_5" as 15
    (["--ep-size", "1_2"], "--ep-size '1_2' is not a list of integers"),
    (["--capacity-factor", "1_5"], "--capacity-factor '1_5' is not a list of numbers"),
    (["--layers", "0_0"], "--layers '0_0': cannot parse '0_0'"),
    (["--layers", "0,,0"], "--layers '0,,0' has an empty item (separate the layers with single commas"),
    # an empty --layers analysed every layer
    (["--layers", ""], "--layers '' is empty (name layers, e.g. 0,2,5-7, or all)"),
])
def test_bad_usage_is_one_line_exit_2(args, words, ids_trace):
    trace = ids_trace
    res = run("balance", trace, *args, "--no-progress")
    assert res.exit_code == 2, res.output
    assert res.output.startswith("routetool: error:") and words in res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_balance_on_dumps_directly(tmp_path):
    q = tmp_path / "q.jsonl"
    write_qwen_like(q)
    out = tmp_path / "q.json"
    res = run("balance", "--details", q, "--num-experts", "16", "--ep-size", "4", "--json", out, "--no-progress")
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["kind"] == "ids" and d["layers"][0]["tokens"] == 8 and d["num_experts"] == 16
    assert any("dropped 170 warm-up/dummy rows" in n for n in d["notes"])
    assert "dropped 170 warm-up/dummy rows" in res.output
    assert "not available: an imported dump holds expert ids" in res.output
    folder = tmp_path / "ds"
    write_deepseek_like(folder)
    res = run("balance", "--details", folder, "--ep-size", "8", "--json", tmp_path / "ds.json", "--no-progress")
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


def test_kernel_routing_default_on_a_trace_with_logits(tmp_path, make_trace):
    # the default routes logits with the project's kernel on a GPU, with the reference on the CPU
    # (a load question; the kernel under the Triton interpreter costs about 100x more)
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
    if DEVICE.type == "cuda":
        assert d["routing"].startswith("kernel tiled")
    else:
        assert d["routing"] == "reference (PyTorch, the default without a GPU)"
        assert "routing     reference (PyTorch, the default without a GPU)" in res.output
        assert any("--kernel tiled: the kernel" in n for n in d["notes"])
    layer = d["layers"][0]
    assert layer["expert_counts_assignments"][0] == 24  # every token picks the biased expert
    b = layer["bias_effect"]
    assert b["expert_counts_with_bias_assignments"][0] == 24
    assert b["expert_counts_bias_zeroed_assignments"][0] < 24
    assert b["load_bias_zeroed"]["imbalance_max_over_mean"] < b["load_with_bias"]["imbalance_max_over_mean"]


def test_plots_written_and_protected(tmp_path, ids_trace):
    pytest.importorskip("matplotlib")
    trace = ids_trace
    plots = tmp_path / "figs"
    res = run("balance", trace, "--ep-size", "2", "--plot", plots, "--no-progress")
    assert res.exit_code == 0, res.output
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["balancedness_eplb.png", "expert_load_heatmap.png", "rank_load.png"]
    assert all((plots / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    res = run("balance", trace, "--ep-size", "2", "--plot", plots, "--no-progress")
    assert res.exit_code == 2 and "pass --force" in res.output
    other = tmp_path / "figs2"
    other.mkdir()
    (other / "rank_load.png").symlink_to(tmp_path / "gone.png")  # a dangling link counts as a file there
    res = run("balance", trace, "--ep-size", "2", "--plot", other, "--no-progress")
    assert res.exit_code == 2 and "rank_load.png" in res.output and (other / "rank_load.png").is_symlink()


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch, ids_trace):
    trace = ids_trace
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    res = run("balance", trace, "--ep-size", "2", "--plot", tmp_path / "figs", "--no-progress")
    # a source checkout (the README's install) needs -e '.[plot]': a bare routetool[plot] sends pip to the index
    assert res.exit_code == 2 and "pip install 'routetool[plot]', or from a source checkout pip install -e '.[plot]'" \
        in res.output
    # an empty name is said first, whatever is installed (it was the missing matplotlib)
    res = run("balance", trace, "--ep-size", "2", "--plot", "", "--no-progress")
    assert res.exit_code == 2 and "an empty" in res.output and "matplotlib" not in res.output, res.output


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


def test_import_refusing_counts_suggests_the_options_it_was_given(tmp_path):
    # the hint said `routetool balance FILE`, which fails on a file of several models: --select was lost
    from tests.io.test_imports import _counts_doc

    path = tmp_path / "two models.json"  # a name the shell must have quoted
    path.write_text(json.dumps(_counts_doc()))
    res = run("import", path, "--select", "mixtral/book", "--topk", "2", "-o", tmp_path / "x.safetensors")
    hint = f"(analyse it directly: routetool balance '{path}' --topk 2 --select mixtral/book)"
    assert res.exit_code == 2 and res.output.strip().endswith(hint), res.output
    assert not (tmp_path / "x.safetensors").exists()
    # the suggested command works as it stands
    res = run("balance", path, "--topk", "2", "--select", "mixtral/book", "--ep-size", "2", "--no-progress")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("extra", [[], ["--skip-rows", "3"]], ids=["plain", "token-row option"])
def test_import_refuses_a_counts_file_of_several_models_as_counts_first(tmp_path, extra):
    # import asked for --select first ("the tables have different expert counts ([8, 64]): several
    # models in one file"), and only then said that counts cannot become a trace; an option only
    # token-row dumps read (--skip-rows) was named first, and then suggested to balance, which refuses it
    from tests.io.test_imports import _counts_doc

    path = tmp_path / "counts.json"
    path.write_text(json.dumps(_counts_doc()))
    res = run("import", path, *extra, "-o", tmp_path / "x.safetensors")
    _one_line_error(res, f"{path}: holds per-expert counts, not per-token expert ids: a trace cannot be made from it "
                         f"(analyse it directly: routetool balance {path} --select mixtral; the file holds several "
                         "models: mixtral, olmoe)")  # (it was ', choosing one with --select (e.g. ...)': no command)
    assert not (tmp_path / "x.safetensors").exists()
    # balance keeps asking for --select, and reads the file with it
    _one_line_error(run("balance", path, "--no-progress"), "several models in one file (choose one with --select mixtral; ")
    res = run("balance", path, "--select", "mixtral", "--ep-size", "2", "--no-progress")
    assert res.exit_code == 0, res.output


def test_import_summary_at_80_columns_shows_the_dump_path_on_one_line(tmp_path, monkeypatch):
    # the path was the title of the narrow layer table, wrapped into pieces of its 31 columns:
    # "Imported", "/work/shared/realdata/olmoe-1b-", "7b.layer0.gsm8k.jsonl (jsonl):", ...
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "80")
    (tmp_path / "dumps").mkdir()
    write_mixtral_like(tmp_path / "dumps" / "mixtral-8x7b-instruct.layer0.humaneval.jsonl")
    res = run("import", "dumps/mixtral-8x7b-instruct.layer0.humaneval.jsonl", "-o", "m.safetensors")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(map(len, lines)) <= 80, res.output
    assert "routetool import" in lines[0]
    assert any("input  dumps/mixtral-8x7b-instruct.layer0.humaneval.jsonl (jsonl)" in ln for ln in lines), res.output
    assert lines[-1] == "wrote m.safetensors (ids-only trace)"


@pytest.mark.skipif(not (REALDATA / "expert-counts.olmoe-paper.json").is_file(), reason="needs ../shared/realdata")
def test_balance_tables_at_80_columns_cut_no_number(monkeypatch):
    # the tables ended numbers with "…" at 80 columns: tokens 1,044,…, assign 8,355,…, header max/me…
    monkeypatch.setenv("COLUMNS", "80")
    res = run("balance", "--details", REALDATA / "expert-counts.olmoe-paper.json", "--select", "olmoe-1b-7b-0924", "--topk", "8",
              "--no-progress")
    assert res.exit_code == 0, res.output
    assert "…" not in res.output and max(map(len, res.output.splitlines())) <= 80, res.output
    for number in ("1,044,480", "8,355,840", "25,067,520", "11:273,925,", "1,547,770", "max/mean"):
        assert number in res.output.split(), number


@pytest.mark.skipif(not (REALDATA / "expert-counts.olmoe-paper.json").is_file(), reason="needs ../shared/realdata")
def test_import_refusing_the_olmoe_paper_counts_keeps_select(tmp_path):
    path = REALDATA / "expert-counts.olmoe-paper.json"
    res = run("import", path, "--select", "olmoe-1b-7b-0924", "-o", tmp_path / "x.safetensors")
    assert res.exit_code == 2 and not (tmp_path / "x.safetensors").exists()
    assert res.output.strip().endswith(f"routetool balance {path} --select olmoe-1b-7b-0924)"), res.output


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


def test_sharded_trace_index_is_read_as_one_trace(tmp_path, make_trace):
    pytest.importorskip("routetool.io.sharded")
    router = RouterConfig(num_experts=4, topk=2, route_scale=1.0)
    make_trace("run-00000.safetensors",
               {0: LayerArrays(topk_ids=torch.tensor([[0, 1], [0, 2]], dtype=torch.int32))}, router=router)
    make_trace("run-00001.safetensors",
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


def test_layer_detail_shows_the_eplb_placement(ids_trace):
    # counts [4,2,2,2], 2 GPUs, 2 redundant: e0 gets 3 replicas; packing (see test_balance) puts
    # slots {e1, e3, e0} on GPU 0 (5.33) and {e2, e0, e0} on GPU 1 (4.67)
    trace = ids_trace
    res = CliRunner().invoke(cli, ["balance", "--details", str(trace), "--ep-size", "2", "--redundant", "2", "--layer", "0",
                                   "--no-progress"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "EPLB placement of layer 0" in res.output
    lines = [ln for ln in res.output.splitlines() if "0×3" in ln]
    assert any("1, 3, 0×3" in ln and "5.3" in ln for ln in lines)
    assert any("2, 0×3, 0×3" in ln and "4.7" in ln for ln in lines)
    assert "Windows of layer 0" in res.output


@pytest.fixture
def two_layer_trace(make_trace):
    """``two.safetensors``: ``ids_trace``'s layer 0 and a second layer of other ids."""
    # layer 0 as ids_trace (counts [4,2,2,2]); layer 1: [[1,2],[1,3]], [[2,3],[1,0],[1,2]] -> [1,4,3,2]
    ids1 = torch.tensor([[1, 2], [1, 3], [2, 3], [1, 0], [1, 2]], dtype=torch.int32)
    ids0 = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 3], [0, 3]], dtype=torch.int32)
    return make_trace("two.safetensors", {x: LayerArrays(topk_ids=ids, step_offsets=torch.tensor([0, 2, 5]))
                                          for x, ids in ((0, ids0), (1, ids1))},
                      router=RouterConfig(num_experts=4, topk=2, route_scale=1.0))


def _table_rows(output, title):
    """The first cell of each body row of the table titled ``title`` (between its rule and the next blank line)."""
    lines = output.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith(title))
    rule = next(i for i in range(start, len(lines)) if "───" in lines[i])
    rows = []
    for ln in lines[rule + 1:]:
        if not ln.strip():
            break
        rows.append(ln.split()[0])
    return rows


PER_LAYER_TABLES = {  # title -> the summary row it has with several layers
    "Expert load per layer": "all", "EP ranks: contiguous ep=2": "layers", "EPLB what-if": "mean",
    "Capacity overflow": None, "Drift: prefill vs decode": None,
}


def test_layer_detail_keeps_every_layer_in_the_tables(monkeypatch, two_layer_trace):
    # --layer 1 showed only layer 1 in every per-layer table and dropped the 'all'/'layers'/'mean'
    # rows (the 'layers' footnote stayed); the tables cover --layers, --layer adds layer 1's detail
    monkeypatch.setenv("COLUMNS", "200")  # no cell wraps onto a second line
    trace = two_layer_trace
    plain = run("balance", "--details", trace, "--ep-size", "2", "--no-progress")
    res = run("balance", "--details", trace, "--ep-size", "2", "--layer", "1", "--no-progress")
    assert plain.exit_code == 0 and res.exit_code == 0, res.output
    for title, summary in PER_LAYER_TABLES.items():
        rows = ["0", "1"] + ([summary] if summary else [])
        assert _table_rows(res.output, title) == rows == _table_rows(plain.output, title), title
    assert "'layers' row: mean" in res.output
    # the detail of layer 1, added after what every run shows
    for detail in ("EPLB placement of layer 1", "Windows of layer 1", "Expert load, layer 1 (assignments)",
                   "EP rank load, layer 1 (contiguous ep=2)"):
        assert detail in res.output and detail not in plain.output, detail
    for whole in ("Expert load per layer (layer x expert)", "Expert load, all layers summed",
                  "EP rank load, all layers summed", "Balancedness per layer, before / after EPLB"):
        assert whole in res.output and whole in plain.output, whole
    assert "mean 2.5 assignments/expert, max 4, total 10 assignments" in res.output  # layer 1: [1,4,3,2]
    assert "(layer 0" not in res.output and "layer 0 (" not in res.output


def test_one_layer_has_no_summary_rows_and_no_footnote_for_them(monkeypatch, ids_trace):
    monkeypatch.setenv("COLUMNS", "200")
    trace = ids_trace
    res = run("balance", "--details", trace, "--ep-size", "2", "--layer", "0", "--no-progress")
    assert res.exit_code == 0, res.output
    for title in PER_LAYER_TABLES:
        assert _table_rows(res.output, title) == ["0"], title
    assert "'layers' row" not in res.output

def test_a_counts_file_without_traffic_shows_undefined_statistics(tmp_path, monkeypatch):
    # max/mean, entropy and Gini were 0, the rank sparkline full bars ████, EPLB 0×5 (every
    # redundant slot on expert 0), the rank bars "balancedness 0.000"
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(tmp_path)  # the notes name the source as given: z.json
    Path("z.json").write_text('{"0": [0, 0, 0, 0]}')
    out = tmp_path / "z.out.json"
    res = run("balance", "--details", "z.json", "--json", out, "--no-progress")
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    for load in (d["all_layers"], d["layers"][0]["load"]):
        assert [load[k] for k in ("imbalance_max_over_mean", "cv", "normalized_entropy", "gini")] == [None] * 4
        assert load["assignments"] == 0 and load["idle_experts"] == [0, 1, 2, 3]
    rank = d["layers"][0]["ranks"][0]
    assert rank["hottest_rank"] is None and rank["balancedness_mean_over_max"] is None
    assert d["layers"][0]["windows"][0]["imbalance_max_over_mean"] is None
    assert d["eplb"]["layers"][0]["replicated"] == [{"expert": e, "replicas": 2} for e in range(4)]
    assert d["notes"][0].startswith("z.json holds no traffic")
    load_row = next(ln for ln in res.output.splitlines() if ln.split()[:4] == ["0", "1", "-", "0"])
    assert load_row.split()[4:9] == ["-", "-", "-", "-", "4"]          # max/mean CV entropy Gini idle
    ep_row = next(ln for ln in res.output.splitlines() if ln.split()[:2] == ["0", "-"] and "▁▁▁▁" in ln)
    assert ep_row.split()[7:10] == ["-", "-", "▁▁▁▁"]                   # hottest EP, share, EP loads
    assert "0×2, 1×2, 2×2, 3×2" in res.output and "0×5" not in res.output and "█" * 4 not in res.output
    assert "balancedness - (no assignments)" in res.output
    assert "• z.json holds no traffic (0 assignments in the analysed layers)" in res.output.replace("\n", " ")


def test_sparkline_of_no_load_is_flat_and_low():
    from routetool.report.balance import _spark

    assert _spark([0.0, 0.0, 0.0], lo=0.0).plain == "▁▁▁"
    assert _spark([2.0, 2.0], lo=0.0).plain == "██"          # equal, nonzero: full
    assert _spark([0.0, 4.0], lo=0.0).plain == "▁█"
    assert _spark([None, None]).plain == "-"

# -- bad input from a new user's reports: one line, exit 2, nothing written ----------------------
def _one_line_error(res, *words, exit_code=2):
    assert res.exit_code == exit_code, res.output
    assert res.output.startswith("routetool: error:") and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    for w in words:
        assert w in res.output, res.output


@pytest.mark.parametrize("name, content, words", [
    ("bin.jsonl", b'{"topk_ids":[1,2]}\n\xff\xfe bad\n', ["bin.jsonl: line 2: not UTF-8 text"]),
    ("empty.jsonl", b'{"topk_ids":[]}\n', ["empty.jsonl: line 1: no expert ids"]),
    ("big.jsonl", b'{"topk_ids":[1,2,3,99999999999999999999999]}\n', ["big.jsonl: line 1: expert id", "out of range"]),
    ("nan.json", b'{"m":{"d":{"0":{"0":5,"1":NaN}}}}', ["nan.json: m/d/0: expert 1 count NaN is not a finite number"]),
    ("frac.jsonl", b'{"topk_ids":[1.5,2]}\n', ["frac.jsonl: line 1: expert id 1.5 in topk_ids is not an integer"]),
    ("layer.jsonl", b'{"layer":-1,"topk_ids":[1,2]}\n', ["layer.jsonl: line 1: layer=-1 is not a layer index"]),
    ("garbage.pt", b"garbage", ["garbage.pt: is not a torch.save file"]),
    # weights that replay refuses were written into the trace, exit 0
    ("w.jsonl", b'{"topk_ids":[1,2],"topk_weights":[0.5,NaN]}\n',
     ["w.jsonl: line 1: weight NaN in 'topk_weights' is not a finite number"]),
    ("w.csv", b'layer,topk_ids,topk_weights\n0,"[1, 2]","[0.5, -1]"\n',
     ["w.csv: line 2: weight '-1' in 'topk_weights' is negative (weights must be finite and >= 0; fix the row)"]),
])
@pytest.mark.parametrize("command", ["import", "balance"])
def test_bad_dump_files_are_one_line(tmp_path, command, name, content, words):
    path = tmp_path / name
    path.write_bytes(content)
    args = ["-o", tmp_path / "x.safetensors"] if command == "import" else ["--no-progress"]
    _one_line_error(run(command, path, *args), *words)
    assert not (tmp_path / "x.safetensors").exists()


def test_balance_counts_topk_above_the_inferred_experts_is_one_line(tmp_path):
    # used to report tokens = assignments / 9 for a file of 8 experts
    counts = tmp_path / "c.json"
    counts.write_text(json.dumps({"0": list(range(1, 9))}))
    _one_line_error(run("balance", counts, "--topk", "9", "--no-progress"),
                    f"{counts}: --topk 9 is more than the 8 experts inferred from the counts", "at most 8")
    assert run("balance", counts, "--topk", "2", "--ep-size", "2", "--no-progress").exit_code == 0


def test_negative_sglang_count_is_rejected(tmp_path):
    # used to report Gini 1.67 and entropy -0.24
    pt = tmp_path / "stat.pt"
    torch.save({"logical_count": torch.tensor([[[1, -2, 3]]])}, pt)
    _one_line_error(run("balance", pt, "--no-progress"), "logical_count[0, 0, 1] is -2: counts cannot be negative")


def test_huge_num_experts_is_a_clear_error(tmp_path):
    q = tmp_path / "q.jsonl"
    write_qwen_like(q)
    _one_line_error(run("import", q, "-o", tmp_path / "x.safetensors", "--num-experts", "99999999999"),
                    "--num-experts 99999999999 is out of range")


@pytest.mark.parametrize("doc, words", [
    ({"physical_to_logical_map": [[0, 1, 2, 3]], "num_gpus": True}, "num_gpus is true; expected a positive integer"),
    ({"physical_to_logical_map": [[0, 1, 2, 3]], "num_gpus": 0}, "num_gpus is 0; expected a positive integer"),
    ({"physical_to_logical_map": [[0, 0.5, 2, 3]], "num_gpus": 2}, "physical_to_logical_map[0][1] is 0.5"),
    # another schema, and a flat map (one list of ids, not one per layer), were accepted
    ({"schema": "other/9", "physical_to_logical_map": [[0, 1, 2, 3]], "num_gpus": 2},
     "p.json: schema is \"other/9\"; expected \"routetool.placement/1\" (pass a placement written by `routetool "
     "balance --eplb-out`, or a file in its format)"),
    ({"physical_to_logical_map": [0, 1, 2, 3], "num_gpus": 2},
     "p.json: physical_to_logical_map is one flat list of 4 values; expected one list of logical expert ids per "
     "layer ([[...], ...], as vLLM and SGLang write it) (write one row per layer, or [[...]] for one row that "
     "applies to every layer)"),
])
def test_bad_placement_file_is_one_line(tmp_path, doc, words, ids_trace):
    trace = ids_trace
    placement = tmp_path / "p.json"
    placement.write_text(json.dumps(doc))
    _one_line_error(run("balance", trace, "--ep-size", "2", "--placement", placement, "--no-progress"), words)


def test_recorded_duplicates_are_one_line(tmp_path, make_trace):
    trace = tmp_path / "dup.safetensors"
    ids = torch.tensor([[0, 1], [0, 0]], dtype=torch.int32)
    make_trace(trace, {0: LayerArrays(topk_ids=ids)}, router=RouterConfig(num_experts=4, topk=2, route_scale=1.0))
    _one_line_error(run("balance", trace, "--recorded", "--ep-size", "2", "--no-progress"),
                    "layers.0.topk_ids: layer 0, step 0, row 1: the recorded ids [0, 0] hold one expert twice")


@pytest.mark.parametrize("bad_row, words", [
    ([0, 9], "the recorded ids [0, 9] hold an id outside [0, 8)"),
    ([-1, -1], "the recorded ids [-1, -1] hold -1 on an unpadded row"),
])
@pytest.mark.parametrize("flags", [[], ["--recorded"]])
def test_invalid_recorded_ids_are_bad_input(tmp_path, bad_row, words, flags, make_trace):
    # ids >= E or -1 on unpadded rows were left out of the counts: exit 0, wrong statistics
    trace = tmp_path / "rec.safetensors"
    ids = torch.tensor([[0, 1]] * 3 + [bad_row] * 3, dtype=torch.int32)
    pad = torch.tensor([False, False, False, False, True, False])  # row 4 (padded) is never counted nor named
    arrays = LayerArrays(topk_ids=ids, is_padding=pad, step_offsets=torch.tensor([0, 3, 6]))
    if flags:
        arrays.gating_output = torch.zeros(6, 8)
    make_trace(trace, {0: arrays}, router=RouterConfig(num_experts=8, topk=2, route_scale=1.0))
    _one_line_error(run("balance", trace, *flags, "--no-bias-effect", "--no-progress"),
                    f"{trace}: layers.0.topk_ids: layer 0, step 1, row 3: {words}; 2 unpadded row(s) of the layer "
                    "are invalid (each token picks distinct experts in [0, 8)",
                    "fix the capture, or route the logits: drop --recorded" if flags else "fix the capture)")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (a folder nothing can be created in)")
def test_unwritable_plot_folder_fails_before_the_analysis(tmp_path, ids_trace):
    pytest.importorskip("matplotlib")
    trace = ids_trace
    out = tmp_path / "b.json"
    res = run("balance", trace, "--ep-size", "2", "--plot", "/proc/routetool-figs", "--json", out, "--no-progress")
    _one_line_error(res, "/proc/routetool-figs: cannot create the folder")
    assert not out.exists()  # stopped before any work


def test_plot_creates_missing_parent_folders(tmp_path, ids_trace):
    # docs/balance.md: the folder "must exist or be creatable"; new/sub/deep was refused with
    # "new/sub: folder does not exist (create it first)"
    pytest.importorskip("matplotlib")
    trace = ids_trace
    figs = tmp_path / "new" / "sub" / "deep"
    res = run("balance", trace, "--ep-size", "2", "--plot", figs, "--no-progress")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in figs.iterdir()) == ["balancedness_eplb.png", "expert_load_heatmap.png",
                                                      "rank_load.png"]


@pytest.mark.parametrize("under", ["file", "dangling link"])
def test_plot_folder_under_a_file_is_refused_before_the_analysis(tmp_path, under, ids_trace):
    pytest.importorskip("matplotlib")
    trace = ids_trace
    blocker = tmp_path / "new"
    if under == "file":
        blocker.write_text("not a folder")
    else:
        blocker.symlink_to(tmp_path / "gone")
    out = tmp_path / "b.json"
    res = run("balance", trace, "--ep-size", "2", "--plot", blocker / "sub" / "deep", "--json", out, "--no-progress")
    _one_line_error(res, f"{blocker}: is not a folder, so --plot {blocker / 'sub' / 'deep'} cannot be created in it "
                         "(choose another folder for --plot)")
    assert not out.exists() and not (tmp_path / "gone").exists()


def test_plot_probe_leaves_no_folder_behind(tmp_path, monkeypatch, ids_trace):
    pytest.importorskip("matplotlib")
    from routetool.report import plots

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    trace = ids_trace
    monkeypatch.setattr(plots.tempfile, "mkstemp", full)  # the probe finds the disk full
    (tmp_path / "new").mkdir()
    figs = tmp_path / "new" / "sub" / "deep"
    _one_line_error(run("balance", trace, "--ep-size", "2", "--plot", figs, "--no-progress"),
                    f"{figs}: cannot write figures here (No space left on device)")
    assert list((tmp_path / "new").iterdir()) == []  # sub and deep were created for the probe, then removed


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (a folder nothing can be created in)")
def test_late_plot_write_error_is_one_line(monkeypatch, ids_trace):
    pytest.importorskip("matplotlib")
    from routetool.report import plots

    monkeypatch.setattr(plots, "check_plot_dir", lambda folder, force: Path(folder))  # let it through early
    trace = ids_trace
    res = run("balance", trace, "--ep-size", "2", "--plot", "/proc/routetool-figs", "--no-progress")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "routetool: error: /proc/routetool-figs: cannot create the folder" in res.output


def test_plot_dash_is_refused(ids_trace):
    pytest.importorskip("matplotlib")
    trace = ids_trace
    _one_line_error(run("balance", trace, "--plot", "-", "--no-progress"), "--plot needs a folder")


def test_plot_empty_path_is_refused(tmp_path, monkeypatch, ids_trace):
    # --plot '' wrote the figures into the current folder
    pytest.importorskip("matplotlib")
    trace = ids_trace
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    res = run("balance", trace, "--ep-size", "2", "--plot", "", "--no-progress")
    _one_line_error(res)
    assert res.output.strip() == ("routetool: error: '': --plot needs a folder; an empty path names none (name a "
                                  "folder, e.g. --plot figs, or --plot . for the current folder)")
    assert list(cwd.iterdir()) == []


def test_plot_figure_cannot_be_another_output(tmp_path, ids_trace):
    pytest.importorskip("matplotlib")
    trace = ids_trace
    figs = tmp_path / "figs"
    figs.mkdir()
    _one_line_error(run("balance", trace, "--ep-size", "2", "--plot", figs, "--json", figs / "rank_load.png",
                        "--no-progress"), "is named by --json and is a --plot figure")


def test_one_file_for_two_outputs_is_refused(tmp_path, ids_trace):
    # --json same.json --eplb-out same.json used to write both into one file (exit 0)
    trace = ids_trace
    same = tmp_path / "same.json"
    _one_line_error(run("balance", trace, "--ep-size", "2", "--json", same, "--eplb-out", same, "--no-progress"),
                    "is named for two outputs of one run")
    assert not same.exists()


def test_balance_output_cannot_be_its_input(tmp_path):
    q = tmp_path / "q.jsonl"
    write_qwen_like(q)
    before = q.read_bytes()
    _one_line_error(run("balance", q, "--json", q, "--force", "--no-progress"), "is this run's input")
    assert q.read_bytes() == before


def test_import_never_replaces_its_dump(tmp_path):
    # import in.jsonl -o in.jsonl --force used to replace the dump with the trace
    q = tmp_path / "q.jsonl"
    write_qwen_like(q)
    before = q.read_bytes()
    _one_line_error(run("import", q, "-o", q, "--force"), "is this run's input")
    assert q.read_bytes() == before
    _one_line_error(run("import", q, "-o", "-"), "'-' (stdout) cannot take this output")


@pytest.mark.parametrize("fmt, words", [
    ("sglang", "q.jsonl: is not a torch.save file"),
    ("trace", "q.jsonl: --format trace does not match: this is not a routetool trace"),
])
def test_import_wrong_format_is_one_line(tmp_path, fmt, words):
    q = tmp_path / "q.jsonl"
    write_qwen_like(q)
    res = run("import", q, "--format", fmt, "-o", tmp_path / "x.safetensors")
    _one_line_error(res, words)
    assert "already" not in res.output


def test_balance_format_trace_on_a_dump(tmp_path):
    q = tmp_path / "q.jsonl"
    write_qwen_like(q)
    _one_line_error(run("balance", q, "--format", "trace", "--no-progress"), "--format trace does not match")


@pytest.mark.parametrize("args, flags", [
    (["--num-experts", "8"], "--num-experts applies"),
    (["--topk", "2", "--select", "x"], "--topk, --select apply"),
    (["--skip-rows", "0"], "--skip-rows applies"),          # given, even at its default value
    (["--drop-repeats", "64"], "--drop-repeats applies"),
])
def test_dump_options_on_a_trace_are_refused(args, flags, ids_trace):
    # they used to be ignored silently
    trace = ids_trace
    _one_line_error(run("balance", trace, *args, "--no-progress"), flags, "to routing dumps, not to a trace")


def _sglang_per_pass(path):
    torch.save({"records": [{"forward_pass_id": 0, "rank": 0,
                             "global_physical_count": torch.tensor([[1, 0, 2, 1]], dtype=torch.int32)}]}, path)


def _counts_json(path):
    from tests.io.test_imports import _counts_doc

    path.write_text(json.dumps(_counts_doc()["mixtral"]))


_DUMPS = {  # kind: (file name, writer)
    "jsonl": ("q.jsonl", write_qwen_like),
    "csv": ("ds", write_deepseek_like),
    "sglang-per-token": ("pt.pt", write_sglang_per_token),
    "sglang-stat": ("stat.pt", write_sglang_stat),
    "sglang-per-pass": ("pp.pt", _sglang_per_pass),
    "counts": ("c.json", _counts_json),
}


def _dump(tmp_path, kind):
    """A small dump of each kind that reads its own options (see imports.OPTIONS_READ)."""
    name, write = _DUMPS[kind]
    path = tmp_path / name
    write(path)
    return path


TOKEN_ROWS = "(it reads --num-experts, --topk, --skip-rows, --drop-repeats)"


@pytest.mark.parametrize("kind, args, line", [
    # --select (which chooses the tables of a counts JSON file) ran on token rows: exit 0, nothing said
    ("jsonl", ["--select", "foo"], f"q.jsonl: --select does not apply to a jsonl dump {TOKEN_ROWS} (drop --select)"),
    ("csv", ["--select", "foo"], f"ds: --select does not apply to a csv dump {TOKEN_ROWS} (drop --select)"),
    ("sglang-per-token", ["--select", "x"], f"pt.pt: --select does not apply to an sglang dump {TOKEN_ROWS} (drop "
                                            "--select)"),
    # --skip-rows and --drop-repeats (filters of token rows) on counts: the same numbers as without them
    ("counts", ["--skip-rows", "100000"], "c.json: --skip-rows does not apply to a counts-json file of per-expert "
                                          "counts (it reads --num-experts, --topk, --select) (drop --skip-rows)"),
    ("counts", ["--skip-rows", "0", "--drop-repeats", "1"],  # given, even at the default value
     "c.json: --skip-rows, --drop-repeats do not apply to a counts-json file of per-expert counts (it reads "
     "--num-experts, --topk, --select) (drop --skip-rows, --drop-repeats)"),
    ("sglang-stat", ["--drop-repeats", "64"], "stat.pt: --drop-repeats does not apply to an sglang stat dump of "
                                              "per-expert counts (it reads --num-experts, --topk) (drop --drop-repeats)"),
    ("sglang-per-pass", ["--skip-rows", "1"], "pp.pt: --skip-rows does not apply to an sglang per-pass dump of "
                                              "per-expert counts (it reads --num-experts, --topk) (drop --skip-rows)"),
])
@pytest.mark.parametrize("command", ["balance", "import"])
def test_dump_options_a_format_does_not_read_are_refused(tmp_path, command, kind, args, line):
    # they used to be ignored silently (the docs call that an error for every option)
    path = _dump(tmp_path, kind)
    out = ["-o", tmp_path / "x.safetensors"] if command == "import" else ["--no-progress"]
    res = run(command, path, *args, *out)
    _one_line_error(res)
    if command == "import" and kind in ("counts", "sglang-stat", "sglang-per-pass"):
        # import refuses counts first, whatever the options; the balance it names reads none of these
        line = (f"{path.name}: holds per-expert counts, not per-token expert ids: a trace cannot be made from it "
                f"(analyse it directly: routetool balance {path})")
    assert res.output.strip() == f"routetool: error: {tmp_path}/{line}", res.output
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("kind, args", [
    ("jsonl", ["--num-experts", "16", "--topk", "4", "--skip-rows", "0", "--drop-repeats", "64"]),
    ("csv", ["--num-experts", "64", "--skip-rows", "1", "--drop-repeats", "2"]),
    ("sglang-per-token", ["--num-experts", "4", "--topk", "2", "--skip-rows", "1", "--drop-repeats", "0"]),
    ("sglang-stat", ["--num-experts", "8", "--topk", "2"]),
    ("sglang-per-pass", ["--num-experts", "4", "--topk", "1"]),
    ("counts", ["--num-experts", "8", "--topk", "2", "--select", "book"]),
])
def test_dump_options_a_format_reads_are_accepted(tmp_path, kind, args):
    res = run("balance", _dump(tmp_path, kind), *args, "--ep-size", "2", "--no-progress")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("name, args", [
    # reading it blocked forever
    ("ff.jsonl", ["import", "{fifo}", "-o", "{out}"]),
    ("ff.jsonl", ["balance", "{fifo}", "--no-progress"]),
    ("ff.jsonl", ["import", "{fifo}", "--format", "jsonl", "-o", "{out}"]),
    ("ff.json", ["balance", "{fifo}", "--no-progress"]),  # (a .json is read to tell a trace index from counts)
    # named by its extension alone: 'is already a routetool trace'
    ("ff.safetensors", ["import", "{fifo}", "-o", "{out}"]),
    # a FIFO among the files of a dump folder
    ("dump/b.csv", ["balance", "{folder}", "--no-progress"]),
    ("dump/b.csv", ["import", "{folder}", "-o", "{out}"]),
])
def test_a_fifo_dump_is_refused_at_once(tmp_path, name, args):
    folder = tmp_path / "dump"
    folder.mkdir()
    (folder / "a.csv").write_text('Batch Number,Layer ID,Activated Expert IDs\n0,0,"[1, 2]"\n')
    fifo = tmp_path / name
    os.mkfifo(fifo)
    out = tmp_path / "x.safetensors"
    res = run(*(a.format(fifo=fifo, out=out, folder=folder) for a in args))
    _one_line_error(res)
    assert res.output.strip() == (f"routetool: error: {fifo}: is not a regular file (a FIFO, device or socket); "
                                  "reading it could block (write it to a regular file and pass that)")
    assert fifo.is_fifo() and not out.exists()


def test_a_fifo_placement_is_refused_at_once(tmp_path, ids_trace):
    trace = ids_trace
    fifo = tmp_path / "p.json"
    os.mkfifo(fifo)
    _one_line_error(run("balance", trace, "--ep-size", "2", "--placement", fifo, "--no-progress"),
                    f"{fifo}: is not a regular file (a FIFO, device or socket); reading it could block (pass a "
                    "placement file written by `routetool balance --eplb-out`)")


KERNELS = '''
import torch
from routetool_kernels.reference import musespark1x_routing_reference as ref

def boom(gating_output, bias, *args, **kwargs):
    raise RuntimeError("illegal memory access\\nwith a second line")

def short(gating_output, bias, *args, topk_weights=None, topk_ids=None, **kwargs):
    w, i = ref(gating_output, bias, *args, **kwargs)
    return w[:-1], i[:-1]

def scribble_logits(gating_output, bias, topk, route_scale, topk_weights=None, topk_ids=None, **kwargs):
    out = ref(gating_output, bias, topk, route_scale, **kwargs)
    gating_output.mul_(2.0)
    return out

def scribble_bias(gating_output, bias, topk, route_scale, topk_weights=None, topk_ids=None, **kwargs):
    bias.add_(1.0)
    return ref(gating_output, bias, topk, route_scale, **kwargs)

def no_defaults(gating_output, bias, topk, route_scale, router_output_multiplier, router_score_normalization,
                router_score_division_eps, topk_weights, topk_ids, *, is_padding):
    assert topk_weights is None and topk_ids is None
    return ref(gating_output, bias, topk, route_scale, router_output_multiplier, router_score_normalization,
               router_score_division_eps, is_padding=is_padding)
def ansi(gating_output, bias, *args, **kwargs):
    raise RuntimeError("\\x1b[2J\\x1b[31mscreen cleared\\x00")

def exits(gating_output, bias, *args, **kwargs):
    import sys
    sys.exit(0)

def scribble_padding(gating_output, bias, topk, route_scale, topk_weights=None, topk_ids=None, *, is_padding, **kwargs):
    out = ref(gating_output, bias, topk, route_scale, is_padding=is_padding, **kwargs)
    is_padding.fill_(True)
    return out

def plus_1000(gating_output, bias, topk, route_scale, topk_weights=None, topk_ids=None, **kwargs):
    w, i = ref(gating_output, bias, topk, route_scale, **kwargs)
    return w, i + 1000

def minus_one(gating_output, bias, topk, route_scale, topk_weights=None, topk_ids=None, **kwargs):
    w, i = ref(gating_output, bias, topk, route_scale, **kwargs)
    return w, torch.full_like(i, -1)

def twice(gating_output, bias, topk, route_scale, topk_weights=None, topk_ids=None, **kwargs):
    w, i = ref(gating_output, bias, topk, route_scale, **kwargs)
    i = i.clone()
    i[:, 1] = i[:, 0]
    return w, i

def wide_weights(gating_output, bias, topk, route_scale, topk_weights=None, topk_ids=None, **kwargs):
    w, i = ref(gating_output, bias, topk, route_scale, **kwargs)
    return torch.zeros(w.shape[0], 3), i
def uint8_ids(gating_output, bias, topk, route_scale, topk_weights=None, topk_ids=None, **kwargs):
    w, i = ref(gating_output, bias, topk, route_scale, **kwargs)
    return w, i.to(torch.uint8)
def float64_weights(gating_output, bias, topk, route_scale, topk_weights=None, topk_ids=None, **kwargs):
    w, i = ref(gating_output, bias, topk, route_scale, **kwargs)
    return w.double(), i
def on_meta(gating_output, bias, *args, topk_weights=None, topk_ids=None, **kwargs):
    w, i = ref(gating_output, bias, *args, **kwargs)
    return w.to("meta"), i.to("meta")
'''


@pytest.mark.parametrize("fn, words", [
    ("boom", ["crashed on layer 0, step 0 (RuntimeError: illegal memory access)"]),
    ("short", ["returned ((15, 2) float32, (15, 2) int32) on layer 0, step 0; expected (topk_weights float32 [16, 2], "
               "topk_ids int32 or int64 [16, 2])"]),
    # writes into the inputs went unnoticed (replay and validate report them)
    ("scribble_logits", ["wrote into its input gating_output on layer 0, step 0",
                         "(a routing kernel may write only topk_weights and topk_ids)"]),
    ("scribble_bias", ["wrote into its input bias on layer 0, step 0"]),
    # the kernel's control characters are shown escaped, not sent to the terminal
    ("ansi", [r"crashed on layer 0, step 0 (RuntimeError: \x1b[2J\x1b[31mscreen cleared\x00)"]),
    ("exits", ["crashed on layer 0, step 0 (SystemExit: 0)"]),
    ("scribble_padding", ["wrote into its input is_padding on layer 0, step 0"]),
    ("wide_weights", ["returned ((16, 3) float32, (16, 2) int32) on layer 0, step 0; expected"]),
    # other dtypes than validate's passed, or failed on a padded row (uint8 cannot hold -1)
    ("uint8_ids", ["returned ((16, 2) float32, (16, 2) uint8) on layer 0, step 0; expected"]),
    ("float64_weights", ["returned ((16, 2) float64, (16, 2) int32) on layer 0, step 0; expected"]),
    # invalid ids were left out of the counts: exit 0 with wrong statistics
    ("plus_1000", ["returned invalid topk_ids on layer 0, step 0, row 0: [10",
                   "hold an id outside [0, 8); 23 of the layer's rows are invalid (fix the kernel"]),
    ("minus_one", ["returned invalid topk_ids on layer 0, step 0, row 0: [-1, -1] hold -1 on an unpadded row; 23 of"]),
    ("twice", ["returned invalid topk_ids on layer 0, step 0, row 0: [", "hold one expert twice; 23 of"]),
    # ids on another device (here meta, which holds no data) were a traceback
    ("on_meta", [f"returned topk_weights and topk_ids on device meta on layer 0, step 0; its inputs are on device "
                 f"{DEVICE.type}"]),
])
def test_kernel_that_fails_or_returns_wrong_rows_is_one_line(tmp_path, fn, words, make_trace):
    # a kernel returning n-1 rows used to exit 0 with an undercounted load
    mod = tmp_path / "kernels.py"
    mod.write_text(KERNELS)
    trace = tmp_path / "t.safetensors"
    g = torch.randn(24, 8, generator=torch.Generator().manual_seed(0))
    pad = torch.arange(24) == 23  # the last row is padding (a mask the kernel could write into)
    make_trace(trace, {0: LayerArrays(gating_output=g, is_padding=pad, step_offsets=torch.tensor([0, 16, 24]))})
    # (no --device: these kernels run wherever the trace lands, and a GPU test process
    # cannot switch to the CPU interpreter once the project's kernels were compiled)
    res = run("balance", trace, "--kernel", f"{mod}:{fn}", "--ep-size", "2", "--no-progress")
    # a fault of the kernel under test: exit 1, as replay and validate report it (it was exit 2, bad input)
    _one_line_error(res, f"kernel {mod}:{fn}", *words, exit_code=1)


def test_kernel_is_called_as_replay_calls_it(tmp_path, make_trace):
    # topk_weights/topk_ids were not passed, so a kernel without defaults for them failed
    mod = tmp_path / "kernels.py"
    mod.write_text(KERNELS)
    trace = tmp_path / "t.safetensors"
    g = torch.randn(24, 8, generator=torch.Generator().manual_seed(0))
    make_trace(trace, {0: LayerArrays(gating_output=g, step_offsets=torch.tensor([0, 16, 24]))})
    outs = {}
    for name, args in (("kernel", ["--kernel", f"{mod}:no_defaults"]), ("reference", ["--reference"])):
        outs[name] = tmp_path / f"{name}.json"
        res = run("balance", trace, *args, "--ep-size", "2", "--json", outs[name], "--no-progress")
        assert res.exit_code == 0, res.output
    k, r = (json.loads(outs[x].read_text()) for x in ("kernel", "reference"))
    assert k["routing"].startswith(f"kernel {mod}:no_defaults")
    assert k["layers"][0]["expert_counts_assignments"] == r["layers"][0]["expert_counts_assignments"]
    assert sum(k["layers"][0]["expert_counts_assignments"]) == 24 * 2


@pytest.mark.parametrize("args, line", [
    (["--reference", "--kernel", "seed"],
     "--kernel and --reference exclude each other: each chooses what routes the logits (pass one of them)"),
    (["--kernel", "tiled", "--recorded"],  # even naming the default kernel
     ("--kernel and --recorded exclude each other: --recorded takes the trace's topk_ids, and the reference routes "
      "its bias effect (pass one of them)")),
])
def test_kernel_excludes_reference_and_recorded(tmp_path, args, line, make_trace):
    # --kernel was ignored silently: the reference (or the recorded ids) routed, exit 0
    trace = tmp_path / "t.safetensors"
    g = torch.randn(24, 8, generator=torch.Generator().manual_seed(0))
    make_trace(trace, {0: LayerArrays(gating_output=g, topk_ids=g.topk(2).indices.int(),
                                      step_offsets=torch.tensor([0, 16, 24]))})
    res = run("balance", trace, *args, "--ep-size", "2", "--no-progress")
    _one_line_error(res)
    assert res.output.strip() == f"routetool: error: {line}"


def test_kernel_on_a_dump_is_refused(tmp_path):
    # a dump holds expert ids already: --kernel was ignored silently
    q = tmp_path / "q.jsonl"
    write_qwen_like(q)
    res = run("balance", q, "--num-experts", "16", "--kernel", "seed", "--ep-size", "4", "--no-progress")
    _one_line_error(res)
    assert res.output.strip() == f"routetool: error: {q}: --kernel applies to traces; a dump holds ids already (drop --kernel)"


def test_window_tokens_exclude_padding_through_the_cli(tmp_path, make_trace):
    trace = tmp_path / "pad.safetensors"
    ids = torch.tensor([[0, 1], [0, 2], [2, 3], [-1, -1]], dtype=torch.int32)
    make_trace(trace, {0: LayerArrays(topk_ids=ids, is_padding=torch.tensor([False, False, False, True]),
                                      step_offsets=torch.tensor([0, 2, 4]))},
               router=RouterConfig(num_experts=4, topk=2, route_scale=1.0))
    out = tmp_path / "w.json"
    assert run("balance", trace, "--ep-size", "2", "--windows", "2", "--json", out, "--no-progress").exit_code == 0
    layer = json.loads(out.read_text())["layers"][0]
    assert [w["tokens"] for w in layer["windows"]] == [2, 1] and layer["tokens"] == 3


def test_a_kernel_that_prints_does_not_corrupt_json_on_stdout(tmp_path, make_trace):
    # its print() (on import and on every call) went to stdout, mixed into the JSON document
    mod = tmp_path / "chatty.py"
    mod.write_text("from routetool_kernels.reference import musespark1x_routing_reference as ref\n"
                   "print('chatty: imported')\n"
                   "def route(gating_output, bias, *args, topk_weights=None, topk_ids=None, **kwargs):\n"
                   "    print('chatty: called')\n"
                   "    return ref(gating_output, bias, *args, **kwargs)\n")
    trace = tmp_path / "t.safetensors"
    g = torch.randn(24, 8, generator=torch.Generator().manual_seed(0))
    make_trace(trace, {0: LayerArrays(gating_output=g, step_offsets=torch.tensor([0, 16, 24]))})
    for flag in ("--json", "--eplb-out"):
        res = run("balance", trace, "--kernel", f"{mod}:route", "--ep-size", "2", "--no-progress", flag, "-")
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        assert doc["layers"][0]["expert_counts_assignments"] if flag == "--json" else doc
        assert "chatty: imported" in res.stderr and "chatty: called" in res.stderr


def test_expert_load_footer_counts_assignments(ids_trace):
    # the panel is titled "(assignments)" but its footer said "mean 2.5 tokens/expert": counts
    # [4,2,2,2] are 10 assignments of 5 tokens (top-2)
    trace = ids_trace
    res = run("balance", "--details", trace, "--ep-size", "2", "--layer", "0", "--no-progress")
    assert res.exit_code == 0, res.output
    assert "Expert load, layer 0 (assignments)" in res.output
    assert "mean 2.5 assignments/expert, max 4, total 10 assignments" in res.output
    assert "tokens/expert" not in res.output


def test_expert_load_strip_of_many_experts_names_assignments():
    from rich.console import Console

    from routetool.report.tables import histogram_renderable

    console = Console(width=100, record=True)
    console.print(histogram_renderable([3] * 99 + [6], "Expert load (assignments)"))  # > 64 experts: block strip
    text = console.export_text()
    assert "bar height = assignments / busiest expert" in text
    assert "mean 3.0 assignments/expert, max 6, total 303 assignments" in text


def _balance_counts(tmp_path, doc):
    """``balance`` of a counts JSON at EP size 2: (its output, its JSON's ``eplb``)."""
    path = tmp_path / "counts.json"
    path.write_text(json.dumps(doc))
    out = tmp_path / "b.json"
    res = run("balance", path, "--ep-size", "2", "--json", out, "--no-progress")
    assert res.exit_code == 0, res.output
    return res, json.loads(out.read_text())["eplb"]


def test_eplb_summary_says_when_it_does_not_pay_out_of_sample(tmp_path):
    # four steps (counts tables): expert 0 hot in the first two, experts 1 and 6 (one on each
    # contiguous rank) in the last two. In-sample EPLB helps (0.861 -> 0.939); the placement fitted
    # on the first half replicates expert 0 and loses on the second half (1.000 -> 0.628): the
    # summary shows both as before -> after with one statistic and says that EPLB does not pay.
    doc = {"m": {d: {"0": {str(e): 60 if e in ({0} if i < 2 else {1, 6}) else 10 for e in range(8)}}
                 for i, d in enumerate(["a", "b", "c", "d"])}}
    res, e = _balance_counts(tmp_path, doc)
    assert e["holdout_balancedness_before"]["mean"] == pytest.approx(1.0)
    assert e["holdout_balancedness_after"]["mean"] == pytest.approx(0.628, abs=1e-3)
    assert e["pays_held_out"] is False
    text = " ".join(res.output.split())
    assert ("balancedness, in-sample 0.861 -> 0.939; held-out half 1.000 -> 0.628: EPLB does not pay out of "
            "sample") in text


def test_eplb_summary_statistic_is_one_mean_over_layers(tmp_path):
    # two layers: the in-sample and held-out numbers of the summary are both means over layers
    doc = {"m": {d: {str(layer): {str(e): (60 if e == (i + layer) % 8 else 10) for e in range(8)} for layer in (0, 1)}
                 for i, d in enumerate(["a", "b", "c", "d"])}}
    res, e = _balance_counts(tmp_path, doc)
    mean = lambda key: sum(y[key] for y in e["layers"]) / len(e["layers"])  # noqa: E731
    hb, ha = mean("holdout_balancedness_before"), mean("holdout_balancedness_after")
    assert e["holdout_balancedness_before"]["mean"] == pytest.approx(hb, abs=1e-6)
    assert e["pays_held_out"] is (ha > hb)
    text = " ".join(res.output.split())
    assert (f"balancedness mean over layers, in-sample {e['balancedness_before']['mean']:.3f} -> "
            f"{e['balancedness_after']['mean']:.3f}; held-out half {hb:.3f} -> {ha:.3f}") in text


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU's default routing")
def test_kernel_given_on_the_cpu_still_routes_through_the_kernel(tmp_path, make_trace):
    # --kernel forces the kernel; a Triton kernel is said to run under the Triton interpreter, a plain
    # torch function is not
    trace = tmp_path / "t.safetensors"
    make_trace(trace, {0: LayerArrays(gating_output=torch.randn(12, 8, generator=torch.Generator().manual_seed(2)),
                                      bias=torch.zeros(8), step_offsets=torch.tensor([0, 12]))})
    mod = tmp_path / "plain.py"
    mod.write_text("from routetool_kernels.reference import musespark1x_routing_reference as ref\n"
                   "def fn(g, b, topk, route_scale, router_output_multiplier=None, router_score_normalization='sigmoid',\n"
                   "       router_score_division_eps=None, topk_weights=None, topk_ids=None, *, is_padding=None):\n"
                   "    return ref(g, b, topk, route_scale, router_output_multiplier, router_score_normalization,\n"
                   "               router_score_division_eps, is_padding=is_padding)\n")
    for spec, routing in (("tiled", "kernel tiled (Triton interpreter)"), (f"{mod}:fn", f"kernel {mod}:fn (CPU)")):
        out = tmp_path / f"{len(routing)}.json"
        res = run("balance", trace, "--ep-size", "2", "--kernel", spec, "--json", out, "--no-progress",
                  "--device", "cpu")
        assert res.exit_code == 0, res.output
        d = json.loads(out.read_text())
        assert d["routing"] == routing and not any("default without a GPU" in n for n in d["notes"])
