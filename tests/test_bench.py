"""`routetool bench`: refuses without a GPU; on a GPU, a small sweep with correctness first."""

import csv
import io
import json

import pytest
from click.testing import CliRunner

import mutants
from conftest import HAS_CUDA
from routetool.cli import main


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
def test_bench_without_cuda_exits_2():
    res = CliRunner().invoke(main, ["bench", "--tokens", "1"])
    assert res.exit_code == 2 and "needs a CUDA GPU" in res.output


def test_bench_bad_options_exit_2():
    assert CliRunner().invoke(main, ["bench", "--tokens", "0"]).exit_code == 2
    assert CliRunner().invoke(main, ["bench", "--dtype", "fp8"]).exit_code == 2


@pytest.mark.parametrize("args, words", [
    (["--kernel", "nosuch"], "unknown kernel 'nosuch'"),
    (["--kernel", "./no_such_file.py:fn"], "no such file"),
    (["--baseline", "nosuch"], "--baseline 'nosuch' is not among the timed kernels"),
    (["--topk", "300", "--experts", "256"], "every --topk (300) exceeds every expert count (256)"),
])
def test_bench_option_mistakes_show_on_any_machine(args, words):
    # checked before the GPU is looked for, so that a CPU-only machine reports them too
    res = CliRunner().invoke(main, ["bench", "--tokens", "1", "--no-progress", *args])
    assert res.exit_code == 2 and words in res.output, res.output


@pytest.mark.gpu
def test_bench_small_sweep(tmp_path):
    out, js = tmp_path / "b.csv", tmp_path / "b.json"
    args = ["bench", "--tokens", "1,4096", "--experts", "256", "--dtype", "fp32,bf16", "--kernel", "tiled",
            "--kernel", "seed", "--kernel", "torch", "--kernel", f"{mutants.__file__}:biased_weights",
            "--pdl", "both", "--rep-ms", "5", "--csv", str(out), "--json", str(js), "--no-progress"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1, res.output  # the biased-weights mutant fails its correctness check
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    by = {(r["kernel"].rsplit(":", 1)[-1], r["pdl"], r["num_tokens"], r["dtype"]): r for r in rows}
    ok = by[("tiled", "True", "4096", "bf16")]
    assert ok["status"] == "ok" and float(ok["latency_us_p50"]) > 0 and float(ok["bandwidth_gbps"]) > 0
    assert by[("seed", "True", "4096", "bf16")]["status"].startswith("rejected")
    assert by[("biased_weights", "", "1", "fp32")]["status"].startswith("failed")
    assert float(by[("tiled", "True", "1", "fp32")]["speedup_vs_baseline"]) > 0
    doc = json.loads(js.read_text())
    assert doc["schema"] == "routetool.bench/1" and doc["copy_bandwidth_gbps"] > 1000
