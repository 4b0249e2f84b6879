"""`routetool replay` through click's CliRunner, on the bundled traces and on broken input."""

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from conftest import HAS_CUDA
from routetool.cli import main
from routetool.io.trace import LayerArrays, RouterConfig
from tests.io.test_imports import write_deepseek_like, write_mixtral_like, write_sglang_per_token

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = sorted((ROOT / "traces").glob("*.safetensors"))
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _run(*args):
    return CliRunner().invoke(main, [*map(str, args)], catch_exceptions=False)


def _unpadded_rows(path, layer):
    with safe_open(str(path), "pt") as f:
        g = f.get_tensor(f"layers.{layer}.gating_output")
        pad = f.get_tensor(f"layers.{layer}.is_padding") if f"layers.{layer}.is_padding" in f.keys() else None
    return g.shape[0] - (int(pad.sum()) if pad is not None else 0), (int(pad.sum()) if pad is not None else 0)


def test_two_bundled_traces_exist():
    names = {p.name for p in BUNDLED}
    assert {"musespark1x-synth-bf16.safetensors", "deepseek-v3-hf-tiny.safetensors"} <= names


@pytest.mark.parametrize("trace", BUNDLED, ids=lambda p: p.name)
def test_replay_bundled_trace(trace, tmp_path):
    out = tmp_path / "r.json"
    res = _run("replay", trace, "--device", DEVICE, "--json", out, "--no-progress", "--no-latency")
    assert res.exit_code == 0, res.output
    assert "PASS" in res.output
    doc = json.loads(out.read_text())
    assert doc["schema"] == "routetool.replay/1" and doc["verdict"] == "pass"
    topk = doc["router"]["topk"]
    total = 0
    for layer in doc["layers"]:
        unpadded, padded = _unpadded_rows(trace, layer["layer"])
        # histogram totals == unpadded tokens x topk; padding proven -1 / 0 on every padded row
        assert sum(layer["expert_counts_tokens"]) == unpadded * topk
        assert layer["padded_rows"] == layer["padded_rows_ok"] == padded
        k = layer["comparisons"]["kernel_vs_reference"]
        assert k["rows"] == unpadded + padded and k["padded"] == padded
        assert k["exact"] + k["reordered"] + k["tie_equivalent"] == unpadded
        assert k["mismatch"] == k["invalid"] == 0
        assert k["weight_max_abs_err"] < 1e-5
        total += unpadded * topk
    assert sum(doc["load_all_layers"]["expert_counts_tokens"]) == total
    assert doc["latency"]["measured"] is False


def test_hf_trace_recorded_outputs_are_compared():
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    res = _run("replay", trace, "--device", DEVICE, "--json", "-", "--no-progress", "--no-latency")
    assert res.exit_code == 0
    doc = json.loads(res.stdout)
    rec = doc["totals"]["reference_vs_recorded"]
    # HF uses torch.topk(sorted=False): same experts, another order; weights within fp32 tolerance
    assert rec["rows"] == 1296 and rec["mismatch"] == 0 and rec["invalid"] == 0
    assert rec["exact"] + rec["reordered"] + rec["tie_equivalent"] == 1296
    assert rec["weight_max_rel_err"] < 1e-5


def test_layer_selection_and_histogram_layer():
    trace = ROOT / "traces" / "musespark1x-synth-bf16.safetensors"
    res = _run("replay", trace, "--device", DEVICE, "--layers", "1,3", "--layer", "3", "--no-progress", "--json", "-")
    assert res.exit_code == 0
    doc = json.loads(res.stdout)
    assert [layer["layer"] for layer in doc["layers"]] == [1, 3]
    assert "Expert load, layer 3" in res.stderr
    res = _run("replay", trace, "--device", DEVICE, "--layers", "7", "--no-progress")
    assert res.exit_code == 2 and "has no layer 7" in res.output


def _bad_kernel_file(tmp_path):
    src = tmp_path / "bad_kernel.py"
    src.write_text(
        "from routetool_kernels.reference import musespark1x_routing_reference\n"
        "def route_biased_weights(gating_output, bias, topk, route_scale, router_output_multiplier=None,\n"
        "                         router_score_normalization='sigmoid', router_score_division_eps=None,\n"
        "                         topk_weights=None, topk_ids=None, *, is_padding=None):\n"
        "    w, ids = musespark1x_routing_reference(gating_output, bias, topk, route_scale, router_output_multiplier,\n"
        "                                           router_score_normalization, router_score_division_eps,\n"
        "                                           is_padding=is_padding)\n"
        "    ids = ids.clone(); ids[::7, -1] = (ids[::7, -1] + 1) % gating_output.shape[1]\n"
        "    return w, ids\n"
    )
    return src


def test_wrong_kernel_exits_1_and_names_rows(tmp_path):
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    kernel = f"{_bad_kernel_file(tmp_path)}:route_biased_weights"
    res = _run("replay", trace, "--device", DEVICE, "--kernel", kernel, "--no-progress", "--json", tmp_path / "r.json")
    assert res.exit_code == 1, res.output
    assert "FAIL" in res.output and "First failing rows" in res.output
    assert "kernel/ref: layer" in res.output.split("First failing rows")[1]  # which comparison each row failed
    doc = json.loads((tmp_path / "r.json").read_text())
    k = doc["totals"]["kernel_vs_reference"]
    assert k["mismatch"] + k["invalid"] > 0 and doc["verdict"] == "fail"


def test_nonfinite_rows_are_a_finding(make_trace):
    g = torch.randn(10, 8)
    g[2, 3] = float("nan")
    g[5] = float("-inf")
    path = make_trace("nan.safetensors", {0: LayerArrays(gating_output=g)})
    res = _run("replay", path, "--device", DEVICE, "--no-progress", "--json", "-")
    assert res.exit_code == 0
    doc = json.loads(res.stdout)
    assert doc["layers"][0]["nonfinite_rows"] == doc["inputs"]["nonfinite_rows"] == 2
    assert "2 non-finite rows" in res.stderr


def test_seed_variant_rejects_bf16_trace_with_exit_2():
    trace = ROOT / "traces" / "musespark1x-synth-bf16.safetensors"
    res = _run("replay", trace, "--device", DEVICE, "--kernel", "seed", "--no-progress")
    assert res.exit_code == 2
    assert "kernel 'seed' rejected layer 0" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("fn, dtype, code, words", [
    # validate's rule: a rejection is documented when the docstring names the input's unusual
    # feature (bfloat16 here); float32 logits have none, so naming "float32" documents nothing
    ("names_bf16", torch.bfloat16, 2, "rejected layer 0 step 0 (ValueError: no bf16) (choose another --kernel"),
    ("names_bf16", torch.float32, 1, "rejected layer 0 step 0 (ValueError: no bf16), a rejection its docstring "
                                     "does not document (fix the kernel: every routing kernel must route float32"),
    ("names_float32", torch.float32, 1, "(ValueError: no), a rejection its docstring does not document"),
    ("nodoc", torch.bfloat16, 1, "(NotImplementedError: later), a rejection its docstring does not document (fix "
                                 "the kernel, or name bfloat16 in its docstring as unsupported)"),
    ("type_error", torch.float32, 1, "(TypeError: bad), a rejection its docstring does not document"),
])
def test_a_rejection_is_bad_input_only_when_the_kernel_documents_it(tmp_path, fn, dtype, code, words, make_trace):
    # any ValueError was "rejected ... (choose another --kernel ...)", exit 2, while validate
    # failed the same thing as rejected_undocumented: a finding about the kernel, exit 1
    src = tmp_path / "rejecting.py"
    src.write_text(
        "def names_bf16(g, b, topk, route_scale, *a, **k):\n"
        "    \"\"\"Routing; bfloat16 logits are not supported.\"\"\"\n"
        "    raise ValueError('no bf16')\n"
        "def names_float32(g, b, topk, route_scale, *a, **k):\n"
        "    \"\"\"Routing of float32 logits.\"\"\"\n"
        "    raise ValueError('no')\n"
        "def nodoc(g, b, topk, route_scale, *a, **k):\n"
        "    raise NotImplementedError('later')\n"
        "def type_error(g, b, topk, route_scale, *a, **k):\n"
        "    raise TypeError('bad')\n"
    )
    g = torch.randn(12, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    trace = make_trace("t.safetensors", {0: LayerArrays(gating_output=g)})
    res = _run("replay", trace, "--device", DEVICE, "--kernel", f"{src}:{fn}", "--no-progress", "--no-latency")
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == code and len(lines) == 1 and words in lines[0], res.output
    assert lines[0].startswith(f"routetool: error: {trace}: layers.0.gating_output: kernel ")


def test_seed_variant_replays_fp32_trace():
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    res = _run("replay", trace, "--device", DEVICE, "--kernel", "seed", "--layers", "1", "--no-progress",
               "--no-latency")
    assert res.exit_code == 0, res.output


BAD_INPUT = [
    # (how to make the input (a path, the raw_trace fixture), expected fragment of the one-line error)
    (lambda p, raw: p.write_bytes(b"not a safetensors file"), "not a readable safetensors file"),
    (lambda p, raw: p.write_bytes((ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors").read_bytes()[:5000]),
     "not a readable safetensors file"),
    (lambda p, raw: raw(p, {"layers.0.gating_output": torch.zeros(4, 9)}), "layers.0.gating_output: has 9"),
    (lambda p, raw: raw(p, {"layers.0.gating_output": torch.zeros(4, 8),
                            "layers.0.bias": torch.full((8,), float("nan"))}),
     "layers.0.bias: has 8 non-finite values"),
]


@pytest.mark.parametrize("make,message", BAD_INPUT)
def test_bad_input_is_one_line_exit_2(tmp_path, raw_trace, make, message):
    path = tmp_path / "bad.safetensors"
    make(path, raw_trace)
    res = _run("replay", path, "--device", DEVICE, "--no-progress")
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("routetool: error: ") and str(path) in lines[0]
    assert message in lines[0]


def test_ids_only_trace_counts_load_and_says_what_is_skipped(make_trace):
    ids = torch.tensor([[0, 1], [1, 2], [-1, -1], [1, 7]], dtype=torch.int32)
    pad = torch.tensor([False, False, True, False])
    path = make_trace("ids.safetensors", {0: LayerArrays(topk_ids=ids, is_padding=pad)})
    res = _run("replay", path, "--device", DEVICE, "--no-progress", "--json", "-")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    layer = doc["layers"][0]
    assert layer["ids_only"] is True and layer["expert_counts_tokens"] == [1, 3, 1, 0, 0, 0, 0, 1]
    assert layer["comparisons"]["kernel_vs_reference"]["rows"] == 0 and layer["padded_rows"] == 1
    assert layer["recorded_invalid_rows"] == 0
    assert "hold no logits" in res.stderr and "NOTHING CHECKED" in res.stderr
    assert "(recorded ids)" in res.stderr


def test_a_layer_of_zero_rows_is_said_to_hold_no_rows_not_no_logits(make_trace):
    path = make_trace("empty.safetensors", {0: LayerArrays(gating_output=torch.zeros(0, 8))})
    res = _run("replay", path, "--device", DEVICE, "--no-progress")
    assert res.exit_code == 0, res.output
    assert "NOTHING CHECKED: the replayed layers hold no rows" in res.output, res.output


def test_ids_only_trace_with_invalid_recorded_outputs_fails(make_trace):
    # recorded weights NaN or negative and a repeated id: found without logits or a reference
    ids = torch.tensor([[0, 1], [1, 1], [2, 3], [1, 7]], dtype=torch.int32)
    weights = torch.tensor([[0.5, 0.5], [0.5, 0.5], [float("nan"), 1.0], [-0.1, 1.1]])
    path = make_trace("ids.safetensors", {0: LayerArrays(topk_ids=ids, topk_weights=weights)})
    res = _run("replay", path, "--device", DEVICE, "--no-progress", "--json", "-")
    assert res.exit_code == 1, res.output
    layer = json.loads(res.stdout)["layers"][0]
    assert layer["recorded_invalid_rows"] == 3
    assert {k: v for k, v in layer["recorded_invalid"].items() if v} == {
        "duplicate_id": 1, "nonfinite_weight": 1, "negative_weight": 1}
    assert "3 rows of the recorded outputs are invalid" in res.stderr and "FAIL" in res.stderr
    # the load counts the one valid row only (the repeated id would have counted twice)
    assert layer["expert_counts_tokens"] == [1, 1, 0, 0, 0, 0, 0, 0]
    assert "its load leaves them out" in res.stderr
    # nothing was compared, so no comparison shows a verdict of its own (not "pass" above a FAIL)
    assert "Comparisons" not in res.stderr
    res = _run("replay", path, "--device", DEVICE, "--no-progress", "--json", "-", "--details")
    summary = res.stderr.split("Summary")[1].split("Per layer")[0]
    verdict = [line for line in summary.splitlines() if line.strip().startswith("verdict")]
    assert len(verdict) == 1 and verdict[0].split()[-1] == "-", summary


def test_usage_errors_exit_2(tmp_path):
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    assert _run("replay", tmp_path / "missing.safetensors").exit_code == 2
    assert _run("replay", trace, "--kernel", "nope").exit_code == 2
    assert _run("replay", trace, "--device", "tpu").exit_code == 2
    assert _run("replay", trace, "--kernel", "nomodule_xyz:fn").exit_code == 2


def test_json_output_is_never_overwritten_without_force(tmp_path):
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    out = tmp_path / "keep.json"
    out.write_text("user data")
    res = _run("replay", trace, "--device", DEVICE, "--json", out, "--no-progress")
    assert res.exit_code == 2 and "already exists" in res.output
    assert out.read_text() == "user data"
    res = _run("replay", trace, "--device", DEVICE, "--json", out, "--force", "--no-progress", "--layers", "1")
    assert res.exit_code == 0 and json.loads(out.read_text())["schema"] == "routetool.replay/1"
    res = _run("replay", trace, "--device", DEVICE, "--json", tmp_path / "no" / "dir.json", "--no-progress")
    assert res.exit_code == 2 and "folder does not exist" in res.output


@pytest.mark.skipif(HAS_CUDA, reason="the CPU message only appears without a GPU")
def test_cpu_says_latency_is_not_measured():
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    res = _run("replay", trace, "--layers", "1", "--no-progress")
    assert "Triton interpreter" in res.output and "not measured" in res.output


def _kernels_file(tmp_path):
    src = tmp_path / "user_kernels.py"
    src.write_text(
        "import torch\n"
        "from routetool_kernels.reference import musespark1x_routing_reference as ref\n"
        "def raises(g, b, topk, route_scale, *a, **k):\n"
        "    raise RuntimeError('boom\\nsecond line')\n"
        "def exits(g, b, topk, route_scale, *a, **k):\n"
        "    raise SystemExit(0)\n"
        "def zeroes_bias(g, b, topk, route_scale, *a, **k):\n"
        "    w, ids = ref(g, b, topk, route_scale)\n"
        "    b.zero_()\n"
        "    return w, ids\n"
        "def short(gating_output, bias, topk, route_scale, router_output_multiplier=None,\n"
        "          router_score_normalization='sigmoid', router_score_division_eps=None, topk_weights=None,\n"
        "          topk_ids=None, *, is_padding=None):\n"
        "    w, ids = ref(gating_output, bias, topk, route_scale, router_output_multiplier,\n"
        "                 router_score_normalization, router_score_division_eps, is_padding=is_padding)\n"
        "    return w[:-1], ids[:-1]\n"
        "def int8_ids(g, b, topk, route_scale, *a, **k):\n"
        "    w, ids = ref(g, b, topk, route_scale)\n"
        "    return w, ids.to(torch.int8)\n"
        "def float64_weights(g, b, topk, route_scale, *a, **k):\n"
        "    w, ids = ref(g, b, topk, route_scale)\n"
        "    return w.double(), ids\n"
        "def rejects(g, b, topk, route_scale, *a, **k):\n"
        "    raise ValueError('boom')\n"
        "def no_defaults(gating_output, bias, topk, route_scale, router_output_multiplier,\n"
        "                router_score_normalization, router_score_division_eps, topk_weights, topk_ids, *,\n"
        "                is_padding):\n"
        "    return ref(gating_output, bias, topk, route_scale, router_output_multiplier,\n"
        "               router_score_normalization, router_score_division_eps, is_padding=is_padding)\n"
    )
    return src


@pytest.mark.parametrize("fn,message", [("raises", "crashed on layer 1 step 0 (RuntimeError: boom)"),
                                        ("exits", "crashed on layer 1 step 0 (SystemExit: 0)"),
                                        ("zeroes_bias", "wrote into its input bias on layer 1 step 0"),
                                        ("short", "returned ((383, 8) float32, (383, 8) int32) on layer 1 step 0"),
                                        # other dtypes passed replay while validate failed them (wrong_dtype)
                                        ("int8_ids", "returned ((384, 8) float32, (384, 8) int8) on layer 1 step 0; "
                                                     "expected (topk_weights float32 [384, 8], topk_ids int32 or int64"),
                                        ("float64_weights", "returned ((384, 8) float64, (384, 8) int32) on layer 1"),
                                        # an undocumented rejection of float32 logits was bad input (exit 2)
                                        ("rejects", "rejected layer 1 step 0 (ValueError: boom), a rejection its "
                                                    "docstring does not document (fix the kernel: every routing "
                                                    "kernel must route float32 logits)")])
def test_failing_user_kernel_is_one_line_exit_1(tmp_path, fn, message):
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    kernel = f"{_kernels_file(tmp_path)}:{fn}"
    res = _run("replay", trace, "--device", DEVICE, "--kernel", kernel, "--layers", "1", "--no-progress")
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 1 and len(lines) == 1 and message in lines[0], res.output
    res = _run("validate", trace, "--suite", "none", "--kernel", kernel, "--no-progress", "--device", DEVICE)
    assert res.exit_code == 1 and any(c in res.output for c in ("crash", "wrong_shape", "wrong_dtype",
                                                                "modified_input", "rejected_undocumented"))


def test_outputs_on_another_device_are_one_line_exit_1(tmp_path):
    # outputs on another device than the inputs (meta tensors here; on a GPU, CPU tensors from a
    # CUDA run) were a traceback ("Cannot copy out of meta tensor") in replay, validate and balance
    src = tmp_path / "elsewhere.py"
    src.write_text("from routetool_kernels.reference import musespark1x_routing_reference as ref\n"
                   "def route(g, b, topk, route_scale, *a, topk_weights=None, topk_ids=None, **k):\n"
                   "    w, ids = ref(g, b, topk, route_scale, *a, **k)\n"
                   "    return w.to('meta'), ids.to('meta')\n")
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    kernel = f"{src}:route"
    res = _run("replay", trace, "--device", DEVICE, "--kernel", kernel, "--layers", "1", "--no-progress")
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 1 and len(lines) == 1, res.output
    assert (f"kernel {kernel!r} returned topk_weights and topk_ids on device meta on layer 1 step 0; its inputs "
            f"are on device {DEVICE}") in lines[0], res.output
    res = _run("validate", trace, "--family", "ties", "--kernel", kernel, "--no-progress", "--device", DEVICE,
               "--json", "-")
    assert res.exit_code == 1 and "Traceback" not in res.output
    cases = json.loads(res.stdout)["cases"]
    assert {c["failure_classes"][0] for c in cases if c["verdict"] != "skipped"} == {"wrong_device"}
    assert "returned topk_weights and topk_ids on device meta" in cases[0]["message"]
    trace_cases = [c for c in cases if c["family"].startswith("trace:")]
    assert [c["name"].rsplit("/", 1)[1] for c in trace_cases] == ["layer1", "layer2", "layer3"]  # one per layer
    assert "returned topk_weights and topk_ids on device meta on layer 1 step 0" in trace_cases[0]["message"]


def test_a_kernel_imports_the_modules_beside_it(tmp_path, monkeypatch):
    # a .py kernel could not import a module of its folder, and a module name was not looked up
    # in the current directory (the console script does not put it on sys.path): ModuleNotFoundError
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    before = list(sys.path)
    folder = tmp_path / "kernels"
    folder.mkdir()
    (folder / "sibling_of_kernel_e6.py").write_text(
        "from routetool_kernels.reference import musespark1x_routing_reference as ref\n")
    code = ("from sibling_of_kernel_e6 import ref\n"
            "def route(g, b, *a, topk_weights=None, topk_ids=None, **k):\n"
            "    return ref(g, b, *a, **k)\n")
    (folder / "uses_sibling_e6.py").write_text(code)
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    res = _run("replay", trace, "--device", DEVICE, "--kernel", f"{folder / 'uses_sibling_e6.py'}:route", "--layers",
               "1", "--no-progress", "--no-latency")
    assert res.exit_code == 0 and "PASS" in res.output, res.output
    assert sys.path == before  # the folder was on sys.path only while the kernel was imported
    monkeypatch.chdir(folder)
    (folder / "kernel_in_cwd_e6.py").write_text(code)
    res = _run("replay", trace, "--device", DEVICE, "--kernel", "kernel_in_cwd_e6:route", "--layers", "1",
               "--no-progress", "--no-latency")
    assert res.exit_code == 0 and "PASS" in res.output, res.output
    assert sys.path == before
    for name in ("sibling_of_kernel_e6", "kernel_in_cwd_e6"):
        sys.modules.pop(name, None)


def test_kernel_with_the_full_signature_and_no_defaults(tmp_path):
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    kernel = f"{_kernels_file(tmp_path)}:no_defaults"
    res = _run("replay", trace, "--device", DEVICE, "--kernel", kernel, "--layers", "1", "--no-progress",
               "--no-latency")
    assert res.exit_code == 0, res.output


def test_usage_errors_are_one_line_and_outputs_never_clobber_inputs(tmp_path):
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    for args in (["replay", "--bogus"], ["replay", str(trace), "--tie-ulps", "nan"],
                 ["replay", str(trace), "--layers", "3-1"], ["validate", "--family"]):
        res = _run(*args)
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("routetool: error: "), (args, res.output)
    copy = tmp_path / "t.safetensors"
    copy.write_bytes(trace.read_bytes())
    res = _run("replay", copy, "--json", copy, "--force", "--no-progress")
    assert res.exit_code == 2 and "input" in res.output and copy.read_bytes() == trace.read_bytes()
    res = _run("validate", copy, "--suite", "none", "--json", tmp_path / "o", "--junit", tmp_path / "o")
    assert res.exit_code == 2 and "two outputs" in res.output


def test_interpreter_wrapped_exceptions_are_unwrapped():
    # the Triton interpreter re-raises a kernel's exception as InterpreterError(repr(e)), once per
    # interpreted call; the one-line report names the original
    from routetool.errors import first_line

    class InterpreterError(Exception):
        pass

    try:
        try:
            try:
                raise ValueError("All-NaN slice encountered\nmore")
            except ValueError as e:
                raise InterpreterError(repr(e)) from e
        except InterpreterError as e:
            raise InterpreterError(repr(e)) from e
    except InterpreterError as e:
        wrapped = e
    assert first_line(wrapped) == "ValueError: All-NaN slice encountered"
    assert first_line(wrapped, with_type=False) == "All-NaN slice encountered"
    assert first_line(SystemExit(0)) == "SystemExit: 0" and first_line(RuntimeError()) == "RuntimeError"


def test_a_dangling_link_as_output_needs_force(tmp_path):
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "nowhere.json")
    res = _run("replay", trace, "--device", DEVICE, "--layers", "1", "--no-progress", "--no-latency", "--json", link)
    assert res.exit_code == 2 and "already exists" in res.output
    assert link.is_symlink()


def test_outputs_never_replace_the_kernel_file_a_fifo_or_a_file_of_an_input_folder(tmp_path):
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    kernel_file = tmp_path / "k.py"
    kernel_file.write_text("from routetool_kernels import fused_musespark1x_routing as fn\n")
    before = kernel_file.read_bytes()
    res = _run("replay", trace, "--device", DEVICE, "--layers", "1", "--no-progress", "--no-latency",
               "--kernel", f"{kernel_file}:fn", "--json", kernel_file, "--force")
    assert res.exit_code == 2 and "is this run's input" in res.output and kernel_file.read_bytes() == before
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    res = _run("info", trace, "--json", fifo, "--force")
    assert res.exit_code == 2 and "not a regular file" in res.output and fifo.is_fifo()
    folder = tmp_path / "dump"
    folder.mkdir()
    (folder / "a.csv").write_text('Batch Number,Layer ID,Activated Expert IDs\n0,0,"[1, 2]"\n')
    res = _run("import", folder, "-o", folder / "a.csv", "--force")
    assert res.exit_code == 2 and "in this run's input folder" in res.output
    assert (folder / "a.csv").read_text().startswith("Batch Number")


def test_a_kernel_module_that_exits_on_import_is_one_line_exit_2(tmp_path):
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    kernel_file = tmp_path / "k.py"
    kernel_file.write_text("raise SystemExit(0)\n")
    res = _run("replay", trace, "--device", DEVICE, "--no-progress", "--kernel", f"{kernel_file}:fn")
    assert res.exit_code == 2 and "cannot import (SystemExit: 0)" in res.output


@pytest.mark.parametrize("name", ["notes.md", "sub/notes.md", "sub/", "sub"])
def test_a_kernel_path_that_is_no_python_file_is_named_as_such(tmp_path, monkeypatch, name):
    # README.md:fn said "cannot import (AttributeError: 'NoneType' object has no attribute 'loader')"; a bare
    # folder name was imported as a namespace package: "has no function 'fn'"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "notes.md").write_text("# notes\n")
    (tmp_path / "sub" / "notes.md").write_text("# notes\n")
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    res = _run("replay", trace, "--device", DEVICE, "--no-progress", "--kernel", f"{name}:fn")
    assert res.exit_code == 2 and res.output.strip() == (
        f"routetool: error: {name}: is not a .py file or an importable module (name a "
        "Python file, --kernel path/to/kernel.py:function, or a module on the path, --kernel "
        "package.module:function)"), res.output


def test_a_file_name_over_the_system_limit_is_one_line_exit_2(tmp_path):
    res = _run("info", tmp_path / ("a" * 300 + ".safetensors"))
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("routetool: error: "), res.output


def test_validate_of_an_ids_only_trace_says_nothing_was_validated(make_trace):
    ids = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
    path = make_trace("ids.safetensors", {0: LayerArrays(topk_ids=ids)})
    res = _run("validate", path, "--suite", "none", "--device", DEVICE, "--no-progress")
    assert res.exit_code == 0 and "NOTHING CHECKED" in res.output and "PASS" not in res.output, res.output


@pytest.mark.parametrize("spec, words", [
    ("", "--layers '' is empty (name layers, e.g. 0,2,5-7, or all)"),  # replayed every layer
    ("  ", "--layers '  ' is empty"),
    ("1,,2", "--layers '1,,2' has an empty item (separate the layers with single commas, e.g. 0,2,5-7)"),
    ("1,", "--layers '1,' has an empty item"),
])
def test_an_empty_layers_list_or_item_is_refused(spec, words):
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    res = _run("replay", trace, "--device", DEVICE, "--layers", spec, "--no-progress", "--no-latency")
    assert res.exit_code == 2 and res.output.startswith(f"routetool: error: {words}"), res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


def test_a_huge_layers_range_is_one_line(tmp_path):
    # a range used to be expanded into a list first (MemoryError, or a 189 MB message)
    from routetool.errors import RouteToolError
    from routetool.analysis.replay import parse_layers

    with pytest.raises(RouteToolError, match=r"no layer 0 \(in the range '0-99999999999'\)"):
        parse_layers("0-99999999999", [1, 2, 3])
    assert parse_layers("2-3,1", [1, 2, 3]) == [1, 2, 3]
    with pytest.raises(RouteToolError, match="no layer 4, 5, 6, 7, 8, 9, 10, 11, 12, 13 and 2 more"):
        parse_layers(",".join(map(str, range(1, 16))), [1, 2, 3])


def _no_control_characters(text):
    return all(c.isprintable() or c == "\n" for c in text)


def test_control_characters_in_a_kernel_error_are_shown_escaped(tmp_path):
    # a kernel's exception text reached the terminal as-is: an ANSI escape could rewrite the
    # terminal, a NUL or a lone surrogate (a traceback of undecodable bytes) broke the output
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    src = tmp_path / "ctl.py"
    src.write_text("def boom(g, b, topk, route_scale, *a, **k):\n"
                   "    raise RuntimeError('bad \\x00 \\x1b[31mred\\x1b[0m \\udc80 end\\nsecond line')\n")
    shown = r"RuntimeError: bad \x00 \x1b[31mred\x1b[0m \udc80 end"
    res = _run("replay", trace, "--device", DEVICE, "--kernel", f"{src}:boom", "--layers", "1", "--no-progress")
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 1 and len(lines) == 1 and shown in lines[0], res.output
    assert _no_control_characters(res.output)
    res = _run("validate", trace, "--suite", "none", "--kernel", f"{src}:boom", "--device", DEVICE, "--no-progress",
               "--json", "-")
    assert res.exit_code == 1 and _no_control_characters(res.output)
    assert shown in json.loads(res.stdout)["cases"][0]["message"]
    # the same for a module that fails on import
    bad_import = tmp_path / "ctl_import.py"
    bad_import.write_text("raise RuntimeError('x\\x1b[2Jy\\nsecond line')\n")
    res = _run("replay", trace, "--device", DEVICE, "--kernel", f"{bad_import}:fn", "--no-progress")
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and r"cannot import (RuntimeError: x\x1b[2Jy)" in lines[0], res.output


def test_file_names_with_control_characters_are_shown_escaped(tmp_path):
    # a newline in a file name split the one-line error over two lines; an ANSI escape was sent
    # to the terminal (or stripped from a pipe: the error named bad.safetensors, another file);
    # tables and headers did the same, and read brackets in a name as rich markup
    src = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    for name, shown in (("bad\nline.safetensors", r"bad\nline.safetensors"),
                        ("bad\x1b[2J.safetensors", r"bad\x1b[2J.safetensors")):
        path = tmp_path / name
        path.write_bytes(src.read_bytes()[:100])  # truncated
        res = _run("info", path)
        assert res.exit_code == 2 and res.output == (
            f"routetool: error: {tmp_path}/{shown}: not a readable safetensors file (Error while deserializing "
            "header: invalid header length) (the file is corrupt or truncated; capture or copy it again)\n")
    path = tmp_path / "ok\x1b[31m[bold]x\n.safetensors"
    path.write_bytes(src.read_bytes())
    shown = r"ok\x1b[31m[bold]x\n.safetensors"

    def flat(text):  # a long name wraps inside a panel: compare without the box and the wrapping
        return re.sub(r"[\s│]", "", text)

    res = _run("replay", path, "--device", DEVICE, "--layers", "1", "--no-progress", "--no-latency")
    assert res.exit_code == 0 and f"trace{tmp_path}/{shown}" in flat(res.output), res.output
    assert _no_control_characters(res.output)
    res = _run("info", path)
    assert res.exit_code == 0 and f"trace{tmp_path}/{shown}" in flat(res.output), res.output
    assert _no_control_characters(res.output)
    res = _run("validate", path, "--suite", "none", "--device", DEVICE, "--no-progress")
    assert res.exit_code == 0 and f"trace:{shown}" in flat(res.output) and _no_control_characters(res.output)
    res = _run("balance", path, "--reference", "--ep-size", "2", "--no-progress")
    assert res.exit_code == 0 and f"input{tmp_path}/{shown}(trace)" in flat(res.output), res.output
    assert _no_control_characters(res.output)


def test_first_line_escapes_what_is_not_printable():
    from routetool.errors import first_line, printable

    assert first_line(RuntimeError("a\tb \x07 \x9b1m \u2028second")) == r"RuntimeError: a\tb \x07 \x9b1m"
    assert first_line(ValueError("\udcff"), with_type=False) == r"\udcff"
    assert printable("Grüße, naïve → 世界") == "Grüße, naïve → 世界"  # printable text is unchanged
    assert first_line(RuntimeError("\x1b" * 200), limit=20) == r"RuntimeError: \x1..."


def _printing_kernel(tmp_path):
    src = tmp_path / "chatty.py"
    src.write_text(
        "from routetool_kernels.reference import musespark1x_routing_reference as ref\n"
        "print('chatty: imported')\n"
        "def route(gating_output, bias, topk, route_scale, router_output_multiplier=None,\n"
        "          router_score_normalization='sigmoid', router_score_division_eps=None, topk_weights=None,\n"
        "          topk_ids=None, *, is_padding=None):\n"
        "    print('chatty: called with', tuple(gating_output.shape))\n"
        "    return ref(gating_output, bias, topk, route_scale, router_output_multiplier,\n"
        "               router_score_normalization, router_score_division_eps, is_padding=is_padding)\n"
    )
    return f"{src}:route"


def test_a_kernel_that_prints_does_not_corrupt_json_on_stdout(tmp_path):
    # its print() went to stdout, between and before the JSON document
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    kernel = _printing_kernel(tmp_path)
    res = _run("replay", trace, "--device", DEVICE, "--kernel", kernel, "--layers", "1", "--no-progress",
               "--no-latency", "--json", "-")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["verdict"] == "pass"
    assert "chatty: imported" in res.stderr and "chatty: called with" in res.stderr
    res = _run("validate", trace, "--suite", "none", "--kernel", kernel, "--device", DEVICE, "--no-progress",
               "--json", "-")
    assert res.exit_code == 0 and json.loads(res.stdout)["verdict"] == "pass" and "chatty" in res.stderr
    import xml.etree.ElementTree as ET

    res = _run("validate", trace, "--suite", "none", "--kernel", kernel, "--device", DEVICE, "--no-progress",
               "--junit", "-")
    assert res.exit_code == 0 and ET.fromstring(res.stdout.split("\n", 1)[1]).tag == "testsuites"
    assert "chatty: called with" in res.stderr
    # bench imports the kernel before it checks for a GPU: on a CPU stdout stays empty
    res = _run("bench", "--kernel", kernel, "--tokens", "4", "--experts", "8", "--topk", "2", "--dtype", "fp32",
               "--rep-ms", "1", "--no-progress", "--json", "-")
    assert "chatty: imported" in res.stderr
    if HAS_CUDA:
        assert res.exit_code == 0 and json.loads(res.stdout)["schema"] == "routetool.bench/1", res.output
    else:
        assert res.exit_code == 2 and res.stdout == "", res.output
    # without a document on stdout, stdout is left alone
    res = _run("replay", trace, "--device", DEVICE, "--kernel", kernel, "--layers", "1", "--no-progress",
               "--no-latency")
    assert res.exit_code == 0 and "chatty: imported" in res.stdout


def test_a_kernel_cannot_close_or_bypass_the_output_streams(tmp_path):
    # sys.stdout.close() in a kernel: a traceback from rich (I/O operation on closed file), and
    # with --json - (stdout then stood for stderr) stderr was lost; print(file=sys.__stdout__)
    # landed in the --json - document
    src = tmp_path / "rude.py"
    src.write_text(
        "import sys\n"
        "from routetool_kernels.reference import musespark1x_routing_reference as ref\n"
        "print('rude: imported', file=sys.__stdout__)\n"
        "def close_both(g, b, *a, topk_weights=None, topk_ids=None, **k):\n"
        "    sys.stdout.close()\n"
        "    sys.stderr.close()\n"
        "    sys.__stdout__.close()\n"
        "    return ref(g, b, *a, **k)\n"
        "def to_dunder(g, b, *a, topk_weights=None, topk_ids=None, **k):\n"
        "    print('rude: called', file=sys.__stdout__)\n"
        "    sys.stdout = None\n"
        "    return ref(g, b, *a, **k)\n")
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    streams = sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__
    for command in (["replay", trace, "--layers", "1", "--no-latency"], ["validate", trace, "--suite", "none"]):
        res = _run(*command, "--device", DEVICE, "--kernel", f"{src}:to_dunder", "--no-progress", "--json", "-")
        assert res.exit_code == 0 and json.loads(res.stdout)["verdict"] == "pass", res.output
        assert "rude: imported" in res.stderr and "rude: called" in res.stderr
    res = _run("replay", trace, "--device", DEVICE, "--kernel", f"{src}:close_both", "--layers", "1", "--no-progress",
               "--no-latency")
    assert res.exit_code == 0 and "PASS" in res.stdout, res.output
    res = _run("replay", trace, "--device", DEVICE, "--kernel", f"{src}:close_both", "--layers", "1", "--no-progress",
               "--no-latency", "--json", "-")
    assert res.exit_code == 0 and json.loads(res.stdout)["verdict"] == "pass", res.output
    assert "PASS" in res.stderr and "rude: imported" in res.stderr
    assert (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) == streams  # restored


def test_kernel_stdout_gives_stand_ins_that_forward_and_ignore_close(monkeypatch):
    import io

    from routetool.engine.execution import kernel_stdout

    streams = out, err, real_out, real_err = [io.StringIO() for _ in range(4)]
    for name, stream in zip(("stdout", "stderr", "__stdout__", "__stderr__"), streams):
        monkeypatch.setattr(sys, name, stream)
    for document_on_stdout in (True, False):
        with kernel_stdout(document_on_stdout):
            print("a")
            print("b", file=sys.__stdout__)
            print("c", file=sys.stderr)
            for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
                stream.close()
            sys.stdout = None
        assert [sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__] == streams
        assert not any(stream.closed for stream in streams)
    # with a document on stdout everything went to stderr; without, each write where it was headed
    assert err.getvalue() == "a\nb\nc\nc\n" and out.getvalue() == "a\n" and real_out.getvalue() == "b\n"


def test_ids_only_trace_names_its_first_invalid_recorded_rows(make_trace):
    # the invalid recorded rows were only counted: neither the terminal nor the JSON said which
    ids = torch.tensor([[0, 1], [1, 1], [2, 3], [1, 7], [2, 9], [4, 5]], dtype=torch.int32)
    weights = torch.tensor([[0.5, 0.5], [0.5, 0.5], [float("nan"), 1.0], [-0.5, 1.5], [0.25, 0.75], [0.5, 0.5]])
    path = make_trace("ids.safetensors",
                      {0: LayerArrays(topk_ids=ids, topk_weights=weights, step_offsets=torch.tensor([0, 2, 6]))})
    res = _run("replay", path, "--device", DEVICE, "--no-progress", "--json", "-")
    assert res.exit_code == 1, res.output
    layer = json.loads(res.stdout)["layers"][0]
    assert layer["recorded_invalid_rows"] == 4
    # (layer, step, row of the layer, reasons, recorded ids, recorded weights; NaN is null in JSON)
    assert layer["recorded_invalid_first_rows"] == [
        {"layer": 0, "step": 0, "row": 1, "reasons": ["duplicate_id"], "topk_ids": [1, 1], "topk_weights": [0.5, 0.5]},
        {"layer": 0, "step": 1, "row": 2, "reasons": ["nonfinite_weight"], "topk_ids": [2, 3],
         "topk_weights": [None, 1.0]},
        {"layer": 0, "step": 1, "row": 3, "reasons": ["negative_weight"], "topk_ids": [1, 7],
         "topk_weights": [-0.5, 1.5]},
        {"layer": 0, "step": 1, "row": 4, "reasons": ["id_out_of_range"], "topk_ids": [2, 9],
         "topk_weights": [0.25, 0.75]}]
    shown = res.stderr.split("First invalid recorded rows (3 of 4")[1]
    rows = [line.strip() for line in shown.splitlines() if line.strip().startswith("layer 0")]
    assert rows == ["layer 0 step 0 row 1 (duplicate_id): ids 1 ×2; w 0.500 ×2",
                    "layer 0 step 1 row 2 (nonfinite_weight): ids 2 3; w nan 1.000",
                    "layer 0 step 1 row 3 (negative_weight): ids 1 7; w -0.500 1.500"]


def test_at_most_five_invalid_recorded_rows_are_kept_per_layer(make_trace):
    ids = torch.tensor([[1, 1]] * 8, dtype=torch.int32)
    path = make_trace("ids.safetensors", {0: LayerArrays(topk_ids=ids, step_offsets=torch.tensor([0, 3, 8]))})
    res = _run("replay", path, "--device", DEVICE, "--no-progress", "--json", "-")
    layer = json.loads(res.stdout)["layers"][0]
    assert res.exit_code == 1 and layer["recorded_invalid_rows"] == 8
    assert [(r["step"], r["row"]) for r in layer["recorded_invalid_first_rows"]] == [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4)]
    assert all(r["topk_weights"] is None for r in layer["recorded_invalid_first_rows"])  # no weights recorded
    assert "First invalid recorded rows (3 of 8" in res.stderr


def test_the_replay_header_of_an_imported_ids_only_trace_says_the_router_parameters_are_unknown(tmp_path):
    # the header showed the placeholders "sigmoid route_scale=1 multiplier=None eps=None" as if real
    src = tmp_path / "m.jsonl"
    write_mixtral_like(src)
    out = tmp_path / "m.safetensors"
    assert _run("import", src, "-o", out).exit_code == 0
    res = _run("replay", out, "--device", DEVICE, "--no-progress", "--no-latency")
    assert res.exit_code == 0, res.output
    header = " ".join(res.output.split("╯")[0].replace("│", " ").split())
    assert "router E=8 topk=2; router parameters unknown (ids-only import: only num_experts and topk are real)" \
        in header, res.output
    assert "route_scale" not in header and "sigmoid" not in header, res.output
    # a trace with its router parameters shows them
    res = _run("replay", ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors", "--device", DEVICE, "--no-progress",
               "--no-latency", "--layers", "1")
    assert "sigmoid route_scale=2.5" in res.output, res.output
    # info's header said the placeholders too
    res = _run("info", out)
    assert res.exit_code == 0, res.output
    header = " ".join(res.output.replace("│", " ").split())
    assert "router E=8 topk=2; router parameters unknown (ids-only import: only num_experts and topk are real)" \
        in header, res.output
    assert "route_scale" not in header and "sigmoid" not in header, res.output


@pytest.fixture
def tie_row_trace(make_trace):
    """``tie_row_trace(path, recorded_scale=1.0, unnormalized=False) -> Path``: a trace whose recorded
    row 1 breaks an exact tie at the k-th place the other way (tie-equivalent), its weights times
    ``recorded_scale``; row 0 is recorded exactly."""
    def make(path, recorded_scale=1.0, unnormalized=False):
        router = RouterConfig(num_experts=8, topk=3, route_scale=2.5)
        g = torch.full((2, 8), -4.0)
        g[:, 0], g[:, 1] = 3.0, 2.0
        g[:, 5] = g[:, 6] = 0.5  # experts 5 and 6 tie for the 3rd place; the rule picks 5
        s = torch.sigmoid(g)
        ids = torch.tensor([[0, 1, 5], [0, 1, 6]], dtype=torch.int32)
        picked = s.gather(1, ids.long())
        w = picked * 2.5 if unnormalized else picked * 2.5 / picked.sum(-1, keepdim=True)
        w[1] *= recorded_scale
        extra = {"weights_semantics": "unnormalized"} if unnormalized else {}
        return make_trace(path, {0: LayerArrays(gating_output=g, topk_ids=ids, topk_weights=w)}, router=router,
                          **extra)
    return make


@pytest.mark.parametrize("unnormalized", [False, True])
def test_recorded_tie_equivalent_rows_have_their_weights_checked_against_their_own_picks(unnormalized, tie_row_trace):
    ok = _run("replay", tie_row_trace("ok.safetensors", unnormalized=unnormalized), "--device", DEVICE,
              "--no-progress", "--no-latency", "--json", "-")
    assert ok.exit_code == 0, ok.output
    totals = json.loads(ok.stdout)["totals"]["reference_vs_recorded"]
    assert totals["tie_equivalent"] == 1 and totals["weight_rows_over_tolerance"] == 0
    bad = _run("replay", tie_row_trace("bad.safetensors", 2.0, unnormalized), "--device", DEVICE,
               "--no-progress", "--no-latency", "--json", "-")
    assert bad.exit_code == 1, bad.output
    totals = json.loads(bad.stdout)["totals"]["reference_vs_recorded"]
    assert totals["tie_equivalent"] == 1 and totals["weight_rows_over_tolerance"] == 1
    assert totals["weight_max_rel_err"] == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("kind, name, write", [
    # the dump of the report: replay said "not a JSON trace index (Extra data: line 2 column 1 ...)"
    ("a JSON-lines routing dump", "m.jsonl", write_mixtral_like),
    ("a JSON-lines routing dump", "m.log", write_mixtral_like),  # found by content, as import finds it
    ("a folder of CSV routing dumps", "ds", write_deepseek_like),  # was "is a directory, not a trace file"
    ("an SGLang routing dump (.pt)", "pt.pt", write_sglang_per_token),
])
@pytest.mark.parametrize("command", [
    ["replay", "DUMP", "--no-latency", "--no-progress"], ["info", "DUMP"],
    ["validate", "DUMP", "--suite", "none", "--no-progress"], ["bench", "--trace", "DUMP", "--no-progress"],
])
def test_trace_commands_name_a_routing_dump_and_the_commands_that_read_it(tmp_path, command, kind, name, write):
    dump = tmp_path / name
    write(dump)
    res = _run(*[dump if a == "DUMP" else a for a in command])
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [
        f"routetool: error: {dump}: looks like {kind}, not a routetool trace (convert it with `routetool import {dump} "
        f"-o trace.safetensors`, or analyse its load with `routetool balance {dump}`)"], res.output


@pytest.fixture
def recorded_trace(make_trace):
    """``recorded_trace(path, factor=None, per_row=False, wrong_ids=False) -> Path``: a trace whose
    recorded outputs are the reference's, with weights times ``factor`` (one for every row, or with
    ``per_row`` another one per row), or with one id changed on row 0."""
    from routetool_kernels.reference import musespark1x_routing_reference as ref

    def make(path, factor=None, per_row=False, wrong_ids=False):
        g = torch.randn(24, 8, generator=torch.Generator().manual_seed(5))
        router = RouterConfig(num_experts=8, topk=2, route_scale=2.5)
        w, ids = ref(g, torch.zeros(8), 2, 2.5)
        if factor is not None:
            w = w * (factor * (1 + torch.arange(24.0)[:, None] / 24) if per_row else factor)
        if wrong_ids:
            ids = ids.clone()
            ids[0] = torch.tensor([i for i in range(8) if i not in ids[0].tolist()][:2], dtype=ids.dtype)
        return make_trace(path, {0: LayerArrays(gating_output=g, step_offsets=torch.tensor([0, 24]), topk_ids=ids,
                                                topk_weights=w)}, router)
    return make


@pytest.mark.parametrize("how, pattern", [
    # every weight off by one factor, ids equal: another route_scale
    (dict(factor=0.4), "the recorded weights are the reference's times 0.4 on every row, with the same ids: the "
                       "engine's routing may have other semantics than the trace's router metadata (a route_scale of "
                       "1, not 2.5?)"),
    # a factor per row: another renormalization
    (dict(factor=0.4, per_row=True), "each row's recorded weights are the reference's times a factor of its own"),
    # a mismatch: no pattern to name
    (dict(wrong_ids=True), None),
])
def test_fail_line_quotes_the_failing_comparison(tmp_path, how, pattern, recorded_trace):
    # the FAIL line used to quote kernel/ref ("0 mismatch, 0 invalid") when recorded/ref failed
    trace = tmp_path / "t.safetensors"
    recorded_trace(trace, **how)
    js = tmp_path / "r.json"
    res = CliRunner().invoke(main, ["replay", str(trace), "--no-latency", "--no-progress", "--json", str(js)],
                             terminal_width=80)
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert "FAIL: recorded/ref and kernel/recorded fail; exit code 1 (recorded/ref: 24 rows: " in text
    assert "; kernel/ref passes)" in text and "(kernel/ref:" not in text
    d = json.loads(js.read_text())
    assert d["recorded_pattern"] == (None if pattern is None else d["recorded_pattern"])
    if pattern is None:
        assert "other semantics" not in text
    else:
        assert pattern in text and d["recorded_pattern"].startswith(pattern)


def test_pass_line_counts_what_weakens_a_pass(tmp_path, make_trace):
    # reordered recorded rows are counted in the verdict line, not only in the table
    trace = tmp_path / "t.safetensors"
    from routetool_kernels.reference import musespark1x_routing_reference as ref

    g = torch.randn(10, 8, generator=torch.Generator().manual_seed(6))
    w, ids = ref(g, torch.zeros(8), 2, 1.0)
    make_trace(trace, {0: LayerArrays(gating_output=g, step_offsets=torch.tensor([0, 10]), topk_ids=ids.flip(-1),
                                      topk_weights=w.flip(-1))})
    res = CliRunner().invoke(main, ["replay", str(trace), "--no-latency", "--no-progress"], terminal_width=80)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "0 weights out of tolerance; recorded/ref passes: 10 reordered; kernel/recorded passes: 10 reordered)" in text


def test_pass_line_says_when_a_comparison_is_ids_only(tie_row_trace):
    # unnormalized recorded weights: kernel/recorded compares ids alone, and the verdict line says so
    trace = tie_row_trace("t.safetensors", unnormalized=True)
    res = CliRunner().invoke(main, ["replay", str(trace), "--no-latency", "--no-progress"], terminal_width=80)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "recorded/ref passes: 1 tie-equivalent; kernel/recorded passes: ids only (weights not compared), 1 " \
           "tie-equivalent)" in text
