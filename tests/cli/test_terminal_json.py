"""Every number the terminal prints beside a name is the JSON's number of that name: one name
means one thing (replay's idle experts and boundary ties, balance's rows, tokens and rate)."""

import json
import re
from pathlib import Path

from click.testing import CliRunner

from routetool.cli import main

TINY = Path(__file__).resolve().parents[2] / "traces" / "deepseek-v3-hf-tiny.safetensors"


def _run(args):
    res = CliRunner().invoke(main, args, prog_name="routetool", env={"COLUMNS": "200"}, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res


def _number(pattern: str, text: str) -> int:
    found = re.findall(pattern, text)
    assert len(found) == 1, (pattern, text)
    return int(found[0].replace(",", ""))


def test_replay_prints_the_json_numbers_by_their_names(tmp_path):
    res = _run(["replay", str(TINY), "--json", str(tmp_path / "r.json")])
    doc = json.loads((tmp_path / "r.json").read_text())
    # "idle experts 387 (layer-expert pairs)" beside load_all_layers.idle_experts [], and "N exact ties at the
    # k-th pick" beside totals.*.exact_ties, a different count
    assert _number(r"idle layer-expert pairs ([\d,]+)", res.stdout) == doc["load_all_layers"][
        "idle_layer_expert_pairs"] == sum(len(x["load"]["idle_experts"]) for x in doc["layers"]) > 0
    assert len(doc["load_all_layers"]["idle_experts"]) < doc["load_all_layers"]["idle_layer_expert_pairs"]
    for name, words in (("padded_rows", "padded rows"), ("nonfinite_rows", "non-finite rows"),
                        ("boundary_ties", "boundary ties")):
        assert _number(rf"([\d,]+) {words}", res.stdout) == doc["inputs"][name] == sum(
            x[name] for x in doc["layers"]), name
    assert "exact ties" not in res.stdout


def test_balance_prints_the_json_numbers_by_their_names(tmp_path):
    res = _run(["balance", str(TINY), "--json", str(tmp_path / "b.json")])
    doc = json.loads((tmp_path / "b.json").read_text())
    # "4,060 unpadded rows" beside a rate of the 4,580 rows of JSON's rows, and throughput_token_layers_per_s
    # said "rows x layers"
    assert _number(r"([\d,]+) rows,", res.stdout) == doc["rows"] == sum(
        x["num_tokens"] for x in json.loads(_run(["info", str(TINY), "--json", "-"]).stdout)["layers"])
    assert _number(r"([\d,]+) tokens", res.stdout) == doc["tokens"] == sum(x["tokens"] for x in doc["layers"])
    assert _number(r"([\d,]+) assignments", res.stdout) == doc["assignments"] == doc["all_layers"]["assignments"]
    assert _number(r"([\d,]+) rows/s", res.stdout) == round(doc["rows_per_s"])
    assert doc["rows_per_s"] == doc["rows"] / doc["elapsed_s"] and "throughput_token_layers_per_s" not in doc
    assert _number(r"idle layer-expert pairs ([\d,]+)", res.stdout) == doc["all_layers"][
        "idle_layer_expert_pairs"] == sum(len(x["load"]["idle_experts"]) for x in doc["layers"])
    # without a terminal the progress bar is off and leaves nothing (it left a blank line on stderr)
    assert res.stderr == f"wrote {tmp_path / 'b.json'}\n"


def test_an_ids_only_replay_prints_only_what_applies(tmp_path):
    rows = [json.dumps({"layer": 0, "step": s, "topk_ids": [(t + s) % 8, (t + s + 3) % 8]})
            for s in range(3) for t in range(4)]
    (tmp_path / "ids.jsonl").write_text("\n".join(rows) + "\n")
    _run(["import", str(tmp_path / "ids.jsonl"), "-o", str(tmp_path / "ids.safetensors")])
    res = CliRunner().invoke(main, ["replay", str(tmp_path / "ids.safetensors"), "--json", str(tmp_path / "r.json")],
                             prog_name="routetool", env={"COLUMNS": "200"}, catch_exceptions=False)
    assert "NOTHING CHECKED" in res.stdout
    # it said which kernel would run under the interpreter, "0 with non-finite logits, 0 exact ties", a latency
    # note and "more failing rows"
    for absent in ("Triton", "non-finite", "ties", "latency", "failing rows"):
        assert absent not in res.stdout, absent
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["inputs"] == {"padded_rows": 0, "nonfinite_rows": None, "boundary_ties": None, "ids_only_layers": 1}


def test_one_form_for_ratios_with_their_trailing_zeros():
    from routetool.report.tables import fmt_float

    # "CV 0.39" beside "0.316", "all layers summed 1.6", "(worst L0: 2)"
    assert [fmt_float(v) for v in (0.39, 0.316, 0.6, 0.9996, 1.6, 2.0, 3.184, 0.0012, 1.19e-7, 0.0, None)] == [
        "0.390", "0.316", "0.600", "1.000", "1.600", "2.000", "3.184", "0.00120", "1.19e-07", "0", "-"]


def test_info_writes_whole_numbers_of_the_metadata_with_separators():
    from routetool.report.capture import _number_text

    # "import_rows_dropped 16384" where every other output writes 16,384
    assert [_number_text(t) for t in ("16384", "0", "007", "1e3", "v2", "-5")] == [
        "16,384", "0", "007", "1e3", "v2", "-5"]


def test_the_chart_legend_names_only_the_marks_it_shows():
    import io

    from rich.console import Console

    from routetool.report.tables import histogram_renderable

    def legend(counts):
        console = Console(width=100, record=True, file=io.StringIO())
        console.print(histogram_renderable(counts, "t"))
        return console.export_text()

    # "· = idle expert" stood under a chart of no idle expert
    assert "· = idle expert" not in legend([1 + e % 5 for e in range(128)])
    assert "· = idle expert" in legend([e % 5 for e in range(128)])


def test_diff_prints_the_json_numbers(tmp_path):
    # the tiny trace's recorded ids (A) against the reference's routing of its own logits (B)
    res = CliRunner().invoke(main, ["diff", str(TINY), str(TINY), "--kernel-b", "reference", "--details", "--no-progress",
                                    "--json", str(tmp_path / "d.json")], env={"COLUMNS": "200"})
    assert res.exit_code == 1, res.output
    doc = json.loads((tmp_path / "d.json").read_text())
    out = res.stdout
    assert out.splitlines()[0] == doc["headline"]
    classes = doc["overall"]["classes"]
    for name, words in (("same", "same"), ("weights", "weights only"), ("order", "slot-order flips"),
                        ("tie", "other experts inside near-ties"), ("real", "other experts outside near-ties")):
        assert _number(rf"([\d,]+) {words}", out) == classes[name], name
    assert _number(r"tokens differing in at least one layer ([\d,]+) of", out) == doc["overall"]["tokens_differing"]
    assert _number(r"\(first [\d,]+ of ([\d,]+) tokens differing\)", out) == doc["first_divergence"]["tokens_differing"]
    assert _number(r"\(first ([\d,]+) of [\d,]+ tokens differing\)", out) == len(doc["first_divergence"]["listed"])
