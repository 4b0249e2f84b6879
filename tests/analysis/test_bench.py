"""`routetool bench`: option mistakes refused on any machine, refuses without a GPU; on a GPU, a small
sweep with correctness first."""

import csv
import io
import json
import re

import pytest
import torch
from click.testing import CliRunner

import mutants
from conftest import HAS_CUDA
from routetool_kernels import VARIANT_NAMES
from routetool.analysis.bench import (TORCH_KERNELS, BenchKernel, BenchResult, BenchRow, _call_args, check_fits,
                             host_latencies, point_bytes, trace_step_shapes)
from routetool.cli import main
from routetool.errors import RouteToolError
from routetool.analysis.suite import CaseInput
from routetool.engine.timing import Latency
from routetool.io.trace import LayerArrays


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
def test_bench_without_cuda_exits_2():
    res = CliRunner().invoke(main, ["bench", "--tokens", "1"])
    assert res.exit_code == 2 and "needs a CUDA GPU" in res.output


def test_bench_bad_options_exit_2():
    assert CliRunner().invoke(main, ["bench", "--tokens", "0"]).exit_code == 2
    assert CliRunner().invoke(main, ["bench", "--dtype", "fp8"]).exit_code == 2


@pytest.mark.parametrize("args, words", [
    # torch and torch-compile were accepted but not listed ("use one of tiled, seed or module:function")
    (["--kernel", "nosuch"], "unknown kernel 'nosuch' (use one of tiled, seed, torch, torch-compile or "
                             "module:function)"),
    (["--kernel", "./no_such_file.py:fn"], "no such file"),
    (["--baseline", "nosuch"], "--baseline 'nosuch' is not among the timed kernels"),
    (["--topk", "300", "--experts", "256"], "every --topk (300) exceeds every expert count (256)"),
])
def test_bench_option_mistakes_show_on_any_machine(args, words):
    # checked before the GPU is looked for, so that a CPU-only machine reports them too
    res = CliRunner().invoke(main, ["bench", "--tokens", "1", "--no-progress", *args])
    assert res.exit_code == 2 and words in res.output, res.output


def test_every_kernel_bench_accepts_is_named_in_its_help_and_its_unknown_kernel_error():
    names = (*VARIANT_NAMES, *TORCH_KERNELS)
    error = CliRunner().invoke(main, ["bench", "--kernel", "nosuch", "--no-progress"]).output
    help_text = CliRunner().invoke(main, ["bench", "--help"], terminal_width=200, max_content_width=200).output
    for text in (error, help_text):
        words = set(re.split(r"[\s,:()\[\]]+", text))
        assert set(names) <= words, (names, text)


@pytest.mark.parametrize("args, words", [
    # all but --rep-ms 0 reached the GPU check (a CPU machine said only "no CUDA"); nan and inf went on to time
    (["--rep-ms", "nan"], "'--rep-ms': must be a number, not nan"),
    (["--rep-ms", "inf"], "'--rep-ms': inf is not in the range 1<=x<=60000"),
    (["--rep-ms", "0"], "'--rep-ms': 0.0 is not in the range"),
    (["--tokens", "1,,2"], "--tokens '1,,2' has an empty item"),      # was read as 1,2
    (["--tokens", "64,"], "--tokens '64,' has an empty item"),
    (["--experts", "256,,512"], "--experts '256,,512' has an empty item"),
    # a repeated value timed its points twice
    (["--dtype", "fp32,fp32"], "--dtype 'fp32,fp32' names fp32 twice (name each value once)"),
    (["--tokens", "1,64,1"], "--tokens '1,64,1' names 1 twice (name each value once)"),
    (["--tokens", "64,064"], "--tokens '64,064' names 64 twice"),
    (["--experts", "256,512,256"], "--experts '256,512,256' names 256 twice"),
    (["--topk", "8,8"], "--topk '8,8' names 8 twice"),
    (["--kernel", "seed", "--kernel", "torch", "--kernel", "seed"], "--kernel seed is given twice (give each kernel "
                                                                    "once)"),
    (["--dtype", "fp32,,bf16"], "--dtype 'fp32,,bf16' has an empty item"),  # was read as fp32,bf16
    (["--tokens", str(10**12)], f"--tokens '{10**12}': {10**12} tokens per point is above bench's limit of 16777216"),
    (["--tokens", f"1,{2**24 + 1}"], "above bench's limit of 16777216 (2^24)"),
])
def test_bench_value_mistakes_show_on_any_machine(args, words):
    res = CliRunner().invoke(main, ["bench", "--no-progress", *args])
    assert res.exit_code == 2 and words in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
def test_bench_at_the_token_limit_goes_on_to_the_gpu_check():
    res = CliRunner().invoke(main, ["bench", "--tokens", str(2**24), "--no-progress"])
    assert res.exit_code == 2 and "needs a CUDA GPU" in res.output, res.output


def test_bench_refuses_an_ids_only_trace(tmp_path, make_trace):
    # its step shapes and router settings come from an import, not from a router call
    path = tmp_path / "ids.safetensors"
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    make_trace(path, {0: LayerArrays(topk_ids=ids, step_offsets=torch.tensor([0, 2, 3]))})
    res = CliRunner().invoke(main, ["bench", "--trace", str(path), "--no-progress"])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (f"routetool: error: {path}: holds no gating_output in any layer (an ids-only trace): "
                                  "bench takes step shapes from traces with logits (give a trace with logits, or the "
                                  "shapes with --tokens/--experts/--topk)")


def test_bench_takes_step_shapes_from_layers_with_logits(tmp_path, make_trace):
    path = tmp_path / "mixed.safetensors"
    g = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 1]] * 7, dtype=torch.int32)
    make_trace(path, {0: LayerArrays(gating_output=g, step_offsets=torch.tensor([0, 3, 5])),
                      1: LayerArrays(topk_ids=ids, step_offsets=torch.tensor([0, 7]))})
    shapes, router = trace_step_shapes(path)
    assert shapes == [2, 3] and router.num_experts == 8


def test_point_bytes_and_the_gpu_memory_check():
    # logits T*E*itemsize + bias E*4 + ids and weights T*K*8
    assert point_bytes(4096, 256, 8, torch.bfloat16) == 4096 * 256 * 2 + 256 * 4 + 4096 * 8 * 8
    check_fits([1, 2**24], [512], [8], ["fp32", "bf16"], free_bytes=34 * 2**30)  # 33 GiB + 2 KiB
    with pytest.raises(RouteToolError, match=r"^16,777,216 tokens x 512 experts \(fp32, topk 8\) need 33.0 GiB of inputs "
                                             r"and outputs; the GPU \(H\) has 32.0 GiB free \(lower --tokens"):
        check_fits([1, 2**24], [256, 512], [8, 600], ["bf16", "fp32"], free_bytes=32 * 2**30, gpu_name="the GPU (H)")


@pytest.mark.gpu
def test_bench_small_sweep(tmp_path):
    out, js, page = tmp_path / "b.csv", tmp_path / "b.json", tmp_path / "b.html"
    args = ["bench", "--tokens", "1,4096", "--experts", "256", "--dtype", "fp32,bf16", "--kernel", "tiled",
            "--kernel", "seed", "--kernel", "torch", "--kernel", f"{mutants.__file__}:biased_weights",
            "--pdl", "both", "--rep-ms", "5", "--csv", str(out), "--json", str(js), "--html", str(page),
            "--no-progress"]
    res = CliRunner().invoke(main, args, env={"COLUMNS": "250"})
    assert res.exit_code == 1, res.output  # the biased-weights mutant fails its correctness check
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    by = {(r["kernel"].rsplit(":", 1)[-1], r["pdl"], r["num_tokens"], r["dtype"]): r for r in rows}
    ok = by[("tiled", "True", "4096", "bf16")]
    assert ok["status"] == "ok" and float(ok["latency_us_p50"]) > 0 and float(ok["bandwidth_gbps"]) > 0
    assert by[("seed", "True", "4096", "bf16")]["status"].startswith("rejected")
    assert by[("biased_weights", "", "1", "fp32")]["status"].startswith("failed")
    assert float(by[("tiled", "True", "1", "fp32")]["speedup_vs_baseline"]) > 0
    for r in rows:  # every timed kernel has its host cost beside its latency, with its floor timed in turn with it
        assert (r["host_us_p50"] != "") == (r["status"] == "ok") == (r["empty_launch_host_us_p50"] != ""), r
    assert 0 < float(ok["host_us_p10"]) <= float(ok["host_us_p50"]) <= float(ok["host_us_p90"])
    assert float(ok["host_over_empty_launch"]) == pytest.approx(float(ok["host_us_p50"])
                                                                / float(ok["empty_launch_host_us_p50"]))
    doc = json.loads(js.read_text())
    assert doc["schema"] == "routetool.bench/1" and doc["copy_bandwidth_gbps"] > 1000
    assert "host" in res.output and "x launch" in res.output and "an empty Triton launch took" in res.output
    html = page.read_text(encoding="utf-8")  # the same table as one page, the GPU in its run
    assert "<strong>exit code 1</strong>" in html and "biased_weights" in html and doc["gpu_name"] in html


@pytest.mark.gpu
def test_bench_refuses_a_point_larger_than_the_free_gpu_memory():
    # 2^24 tokens x 2^20 experts of fp32 logits: 64 TiB, refused before the sweep allocates anything
    res = CliRunner().invoke(main, ["bench", "--tokens", str(2**24), "--experts", str(2**20), "--dtype", "fp32",
                                    "--kernel", "torch", "--no-progress"])
    assert res.exit_code == 2, res.output
    assert "16,777,216 tokens x 1,048,576 experts (fp32, topk 8) need 65,537.0 GiB" in res.output
    assert "GiB free (lower --tokens or --experts" in res.output and len(res.output.strip().splitlines()) == 1


def test_bench_calls_a_kernel_by_the_documented_convention():
    # the logits and the bias by position, every other parameter by keyword (bench passed topk and
    # route_scale by position and left the rest at the function's defaults)
    seen = {}

    def kernel(gating_output, bias, *, topk, route_scale, router_output_multiplier, router_score_normalization,
               router_score_division_eps, topk_weights, topk_ids, is_padding):
        seen.update(topk=topk, route_scale=route_scale, multiplier=router_output_multiplier,
                    normalization=router_score_normalization, eps=router_score_division_eps, pad=is_padding,
                    buffers=(topk_weights, topk_ids))
        return topk_weights, topk_ids

    inp = CaseInput.of(torch.zeros(4, 8), torch.zeros(8), 2, route_scale=2.5,
                       topk_weights=torch.empty(4, 2), topk_ids=torch.empty(4, 2, dtype=torch.int32))
    args, kwargs = _call_args(BenchKernel("mine", kernel), inp)
    kernel(*args, **kwargs)
    assert seen == dict(topk=2, route_scale=2.5, multiplier=None, normalization="sigmoid", eps=None, pad=None,
                        buffers=(inp.topk_weights, inp.topk_ids))
    assert _call_args(BenchKernel("tiled", kernel, pdl=False), inp)[1]["use_pdl"] is False
    assert "topk_weights" not in _call_args(BenchKernel("torch", kernel), inp)[1]


def _result_with_host_costs() -> BenchResult:
    result = BenchResult(gpu_name="H", driver_version="1", torch_version="t", triton_version="3", copy_bandwidth_gbps=4000.0,
                         baseline="seed")
    result.rows = [
        BenchRow(kernel="tiled", pdl=True, num_tokens=64, num_experts=256, topk=8, dtype="fp32", cuda_graph=True,
                 status="ok", latency=Latency(1.8, 1.9, 2.0), host=Latency(19.0, 20.0, 22.0),
                 empty_launch=Latency(15.0, 16.0, 18.0), bytes_moved=70656, bandwidth_gbps=37.2, bandwidth_fraction=0.0093,
                 speedup=1.5),
        BenchRow(kernel="seed", pdl=True, num_tokens=64, num_experts=256, topk=8, dtype="fp32", cuda_graph=True,
                 status="ok", latency=Latency(2.8, 2.9, 3.0), host=Latency(21.0, 22.0, 23.0),
                 empty_launch=Latency(12.0, 12.5, 13.0)),
        BenchRow(kernel="seed", pdl=True, num_tokens=64, num_experts=256, topk=8, dtype="bf16", cuda_graph=True,
                 status="rejected: gating_output dtype bfloat16 is not supported"),
    ]
    return result


def test_bench_reports_the_host_cost_beside_the_latency_with_the_floor():
    from rich.console import Console

    from routetool.report.bench import bench_csv, bench_json, render_bench

    result = _result_with_host_costs()
    rows = list(csv.DictReader(io.StringIO(bench_csv(result))))
    assert rows[0]["host_us_p50"] == "20.0" and rows[0]["host_us_p10"] == "19.0" and rows[0]["host_us_p90"] == "22.0"
    assert rows[0]["empty_launch_host_us_p50"] == "16.0" and float(rows[0]["host_over_empty_launch"]) == 1.25
    assert rows[1]["empty_launch_host_us_p50"] == "12.5" and float(rows[1]["host_over_empty_launch"]) == 1.76
    assert rows[2]["host_us_p50"] == "" and rows[2]["host_over_empty_launch"] == ""  # not timed
    doc = bench_json(result)
    assert doc["rows"][0]["host_us_p50"] == 20.0 and doc["rows"][2]["host_us_p50"] is None
    console = Console(record=True, width=200)
    render_bench(result, console)
    text = console.export_text()
    assert "an empty Triton launch took 12.5-16.0 µs of host time per call, timed in turn with each row" in text
    tiled, seed = (next(line for line in text.splitlines() if line.strip().startswith(k)) for k in ("tiled", "seed"))
    assert tiled.split()[-3:] == ["20.0", "1.25x", "ok"], tiled
    assert seed.split()[-3:] == ["22.0", "1.76x", "ok"], seed


def test_host_latencies_time_batches_of_back_to_back_calls_in_turn(monkeypatch):
    # per-call means of batches of back-to-back calls, warm-up calls first, one synchronisation per
    # batch, the functions' batches in turn (so that a floor sees the machine as the kernel does)
    syncs, calls = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append("".join(calls[-1:])))
    lats = host_latencies([lambda: calls.append("a"), lambda: calls.append("b")], calls=50, samples=3, warmup_calls=2)
    assert "".join(calls) == "aabb" + ("a" * 50 + "b" * 50) * 3
    assert syncs == ["b"] + ["a", "b"] * 3
    assert all(0 < x.p10_us <= x.p50_us <= x.p90_us < 1e4 for x in lats) and len(lats) == 2


def test_the_empty_kernel_of_the_floor_launches(device):
    # defined on first use, inside a function (Triton is imported only once the device is chosen)
    from routetool.analysis.bench import empty_kernel

    empty_kernel()[(1,)](torch.zeros(1, dtype=torch.int32, device=device))
    assert empty_kernel() is empty_kernel()
