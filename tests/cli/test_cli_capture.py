"""`routetool synth`, `routetool info` and `routetool capture hf` through click's CliRunner.

The commands are added to a test-local group of the main group's class, which maps
RouteToolError to one line and exit code 2 (as routetool.cli.main does).
"""

import errno
import json
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from routetool.cli import _Group
from routetool.cli.capture import capture, info, synth
from routetool.io.trace import LayerArrays, RouterConfig, open_trace

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "traces" / "text" / "public-domain-openings.txt"


@click.group(cls=_Group)
def cli() -> None:
    """Test-local routetool group."""


cli.add_command(synth)
cli.add_command(info)
cli.add_command(capture)


def _run(*args, input=None):
    return CliRunner().invoke(cli, [str(a) for a in args], input=input, catch_exceptions=False)


def _one_line_error(res, *fragments):
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("routetool: error: "), res.output
    for f in fragments:
        assert f in lines[0], lines[0]
    assert "Traceback" not in res.output


SMALL = ["--layers", "2", "--experts", "48", "--topk", "6", "--prefill", "64,20", "--decode-steps", "5",
         "--max-decode-batch", "12", "--ties", "2", "--seed", "3", "--skew", "zipf:1"]


# ---------------------------------------------------------------------------------------
# synth
def test_synth_writes_a_trace_and_reports_its_statistics(tmp_path):
    out = tmp_path / "s.safetensors"
    res = _run("synth", "-o", out, *SMALL, "--nonfinite", "1", "--bias", "fitted", "--fit-steps", "5",
               "--dtype", "float32", "--padding", "fraction:0.25", "--normalization", "softmax", "--route-scale", "1")
    assert res.exit_code == 0, res.output
    assert "realised statistics" in res.output and f"wrote {out}" in res.output
    with open_trace(out) as t:
        assert t.layers == (0, 1)
        r = t.meta.router
        assert (r.num_experts, r.topk, r.router_score_normalization, r.route_scale) == (48, 6, "softmax", 1.0)
        info0 = t.info(0)
        assert info0.num_steps == 7 and info0.gating_dtype == torch.float32
        steps = list(t.steps(0))
        padded = sum(int(s.is_padding.sum()) for s in steps)
        assert abs(padded - 0.25 * info0.num_tokens) <= 1
        assert sum(int((~torch.isfinite(s.gating_output)).any(-1).sum()) for s in steps) == 1
        assert t.bias(0).abs().max() > 0
    # the same seed gives the same tensors
    again = tmp_path / "again.safetensors"
    assert _run("synth", "-o", again, *SMALL, "--nonfinite", "1", "--bias", "fitted", "--fit-steps", "5",
                "--dtype", "float32", "--padding", "fraction:0.25", "--normalization", "softmax",
                "--route-scale", "1").exit_code == 0
    with open_trace(out) as a, open_trace(again) as b:
        for layer in a.layers:
            ra, rb = a.read_rows(layer, 0, a.info(layer).num_tokens), b.read_rows(layer, 0, b.info(layer).num_tokens)
            assert torch.equal(ra.gating_output.nan_to_num(), rb.gating_output.nan_to_num())


@pytest.mark.parametrize("options, router", [
    (["--n-group", "8", "--topk-group", "4"], {"n_group": 8, "topk_group": 4}),
    (["--n-group", "8", "--topk-group", "2", "--topk-method", "group_limited_greedy"],
     {"n_group": 8, "topk_group": 2, "topk_method": "group_limited_greedy"}),
    (["--normalization", "softmax", "--norm-topk-prob", "false"],
     {"router_score_normalization": "softmax", "norm_topk_prob": False}),
    (["--normalization", "sqrtsoftplus", "--route-scale", "1.5"],
     {"router_score_normalization": "sqrtsoftplus", "route_scale": 1.5}),
    (["--normalization", "topk_then_softmax", "--route-scale", "1"], {"router_score_normalization": "topk_then_softmax",
                                                                     "route_scale": 1.0}),
])
def test_synth_writes_each_routing_semantics(tmp_path, options, router):
    out = tmp_path / "s.safetensors"
    res = _run("synth", "-o", out, *SMALL, "--dtype", "float32", *options)
    assert res.exit_code == 0, res.output
    with open_trace(out) as t:
        assert {k: getattr(t.meta.router, k) for k in router} == router
    # the router's own checks, as one line
    _one_line_error(_run("synth", "-o", tmp_path / "x.safetensors", *SMALL, "--n-group", "5", "--topk-group", "1"),
                    "n_group=5 must divide num_experts=48 into equal groups")


def test_synth_never_overwrites_without_force(tmp_path):
    out = tmp_path / "s.safetensors"
    out.write_bytes(b"user data")
    _one_line_error(_run("synth", "-o", out, *SMALL), str(out), "already exists", "--force")
    assert out.read_bytes() == b"user data"
    assert _run("synth", "-o", out, *SMALL, "--force").exit_code == 0
    with open_trace(out) as t:
        assert t.meta.router.num_experts == 48


def test_disk_full_leaves_the_existing_file_intact(tmp_path, monkeypatch):
    import routetool.io.trace as trace_mod

    out = tmp_path / "s.safetensors"
    assert _run("synth", "-o", out, *SMALL).exit_code == 0
    before = out.read_bytes()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trace_mod, "save_file", full)
    _one_line_error(_run("synth", "-o", out, *SMALL, "--seed", "9", "--force"), str(out), "No space left on device",
                    "free disk space")
    assert out.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temporary file left behind


@pytest.mark.parametrize("args, fragments", [
    (["--skew", "zipf"], ["--skew 'zipf' is not understood", "zipf:A"]),
    (["--padding", "fraction:2"], ["--padding 'fraction:2'", "[0, 1)"]),
    (["--topk", "60"], ["topk=60 must be in [1, num_experts=48]"]),
    (["--prefill", "64,x"], ["--prefill '64,x'"]),
    (["--prefill", "8,,8"], ["--prefill '8,,8' has an empty item (separate the values with single commas, "
                             "e.g. 512,512,97)"]),
    (["--route-scale", "0"], ["route_scale=0.0 must be finite and > 0"]),
    # more non-finite rows than the batch has (they were made silently fewer)
    (["--prefill", "8", "--decode-steps", "0", "--nonfinite", "50"],
     ["--nonfinite 50: a layer has 8 unpadded rows, 2 of them taken by --ties 2, so only 6 can be made non-finite",
      "(pass --nonfinite 6 or fewer, lower --ties, or make more rows (--prefill, --decode-steps, --max-decode-batch))"]),
    # more tie rows than the batch has (they were made silently fewer, in every unpadded row)
    (["--prefill", "8", "--decode-steps", "0", "--ties", "100000"],
     [("--ties 100,000: a layer has 8 unpadded rows, so only 8 can be given a tie at the k-th boundary (pass --ties 8 "
       "or fewer, or make more rows (--prefill, --decode-steps, --max-decode-batch))")]),
    # topk == experts: no k-th boundary to tie at (no ties were made)
    (["--experts", "6", "--ties", "1"], ["--ties 1: topk 6 = experts 6, so every expert is picked",
                                         "(pass --ties 0, or choose more experts than topk)"]),
])
def test_synth_bad_options_exit_2(tmp_path, args, fragments):
    out = tmp_path / "s.safetensors"
    _one_line_error(_run("synth", "-o", out, *SMALL, *args), *fragments)
    assert not out.exists()


@pytest.mark.parametrize("args, ties", [
    (["--prefill", "3", "--decode-steps", "0"], 3),  # fewer unpadded rows than the default 4
    (["--experts", "6", "--topk", "6"], 0),  # topk == experts: nothing to tie
])
def test_synth_default_ties_fit_a_small_trace(tmp_path, args, ties):
    # the default --ties 4 is lowered to what a layer holds; a --ties given on purpose is checked
    out = tmp_path / "s.safetensors"
    i = SMALL.index("--ties")
    small = SMALL[:i] + SMALL[i + 2:]
    res = _run("synth", "-o", out, *small, *args, "--dtype", "float32", "--skew", "uniform")
    assert res.exit_code == 0, res.output
    with open_trace(out) as t:
        assert f" ties={ties} nonfinite=0" in t.meta.provenance


def test_synth_output_folder_problems(tmp_path):
    _one_line_error(_run("synth", "-o", tmp_path / "missing" / "s.safetensors", *SMALL), "folder does not exist")
    _one_line_error(_run("synth", "-o", tmp_path, *SMALL), "is a directory")


# ---------------------------------------------------------------------------------------
# info
def test_info_table_and_json(tmp_path):
    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    res = _run("info", trace)
    assert res.exit_code == 0, res.output
    for text in ("routetool info", "weights_semantics", "renormalized", "Per layer", "Tensors per layer",
                 "gating_output", "topk_weights", "Step shapes", "--scan"):
        assert text in res.output, text
    res = _run("info", trace, "--json", "-", "--scan", "--no-progress")
    assert res.exit_code == 0
    doc = json.loads(res.stdout)
    assert doc["schema"] == "routetool.info/1" and doc["total_tokens"] == 3 * (384 + 12 * 4)
    assert doc["padded_rows"] == 0 and doc["nonfinite_rows"] == 0 and doc["recorded_outputs"] == "all"
    assert [layer["layer"] for layer in doc["layers"]] == [1, 2, 3]
    assert doc["size_bytes"] == trace.stat().st_size


def test_info_json_file_is_never_overwritten_without_force(tmp_path):
    trace = ROOT / "traces" / "musespark1x-synth-bf16.safetensors"
    out = tmp_path / "info.json"
    out.write_text("keep")
    _one_line_error(_run("info", trace, "--json", out), "already exists")
    assert out.read_text() == "keep"
    assert _run("info", trace, "--json", out, "--force", "--scan", "--no-progress").exit_code == 0
    doc = json.loads(out.read_text())
    assert doc["padded_rows"] == 520 and doc["padded_fraction"] == pytest.approx(520 / 4580)


def test_info_on_a_sharded_recording(tmp_path, monkeypatch):
    import sys
    import types

    from routetool_kernels.reference import musespark1x_routing_reference
    from routetool.capture.recorder import RoutingRecorder

    mod = types.ModuleType("routetool_test_cli_routing")

    def routing(gating_output, bias, topk, route_scale, router_output_multiplier=None,
                router_score_normalization="sigmoid", router_score_division_eps=None, topk_weights=None,
                topk_ids=None, *, is_padding=None):
        w, ids = musespark1x_routing_reference(gating_output, bias, topk, route_scale, is_padding=is_padding)
        return w, ids.int()

    mod.fused_musespark1x_routing = routing
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    index = tmp_path / "rec.json"
    with RoutingRecorder(index, target=f"{mod.__name__}:fused_musespark1x_routing", num_layers=2, shard_mb=0.002):
        for n in (30, 4, 4, 8, 2):
            for _ in range(2):
                mod.fused_musespark1x_routing(torch.randn(n, 16), torch.zeros(16), 2, 1.0)
    res = _run("info", index, "--json", "-")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["sharded"] and doc["index"]["complete"] and doc["index"]["num_shards"] >= 2
    assert doc["layers"][0]["step_tokens"] == [30, 4, 4, 8, 2]
    assert doc["size_bytes"] == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert "sharded" in _run("info", index).output


@pytest.mark.parametrize("make, fragments", [
    (lambda p: p / "nope.safetensors", ["nope.safetensors: no such file"]),
    (lambda p: (p / "x.safetensors").write_bytes(b"\x10" * 40) and p / "x.safetensors", ["not a readable safetensors"]),
    (lambda p: (p / "r.json").write_text('{"schema": "routetool.replay/1"}') and p / "r.json",
     ["not a routetool trace index"]),
])
def test_info_bad_input_exit_2(tmp_path, make, fragments):
    _one_line_error(_run("info", make(tmp_path)), *fragments)


def test_info_refuses_an_index_whose_complete_is_not_a_boolean(make_sharded):
    # "complete": "yes" used to be shown as a complete recording
    index = make_sharded("run.json", [{0: LayerArrays(gating_output=torch.zeros(3, 4))}],
                         RouterConfig(num_experts=4, topk=2))
    index.write_text(index.read_text().replace('"complete": true', '"complete": "yes"'))
    _one_line_error(_run("info", index), f'{index}: index.complete: "complete" is "yes", not a JSON boolean',
                    'write "complete": true')


@pytest.mark.parametrize("tensors, meta, fragments", [
    # info used to show one layer 0 (the second name's tensors silently replaced the first's)
    ({"layers.0.gating_output": torch.zeros(3, 4), "layers.00.gating_output": torch.ones(3, 4)}, {},
     ["t.safetensors: layers.00.gating_output: layer index '00' has a leading zero",
      "two names for layer 0", "(keep one of layers.0.gating_output and layers.00.gating_output"]),
    # int() reads Arabic-Indic digits: info showed layer 3
    ({"layers.\u0663.gating_output": torch.zeros(3, 4)}, {}, ["layer index '\u0663' is not a plain decimal index"]),
    # float("2_5") is 25.0: info showed route_scale 25
    ({"layers.0.gating_output": torch.zeros(3, 4)}, {"route_scale": "2_5"},
     ["t.safetensors: __metadata__: metadata route_scale='2_5' is not a plain decimal number"]),
])
def test_info_refuses_loose_layer_names_and_numbers(raw_trace, tensors, meta, fragments):
    trace = raw_trace("t.safetensors", tensors, RouterConfig(num_experts=4, topk=2), **meta)
    _one_line_error(_run("info", trace), *fragments)


# ---------------------------------------------------------------------------------------
# capture hf
HF_SMALL = ["--batch", "2", "--prompt-tokens", "10", "--max-new-tokens", "3", "--set", "hidden_size=32",
            "--set", "intermediate_size=64", "--set", "moe_intermediate_size=16"]


def test_capture_hf_arch_and_replayable_trace(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "glm.safetensors"
    res = _run("capture", "hf", "--arch", "glm4_moe", "--text", TEXT, "-o", out, *HF_SMALL)
    assert res.exit_code == 0, res.output
    assert "routetool capture hf" in res.output and "renormalized" in res.output
    with open_trace(out) as t:
        assert t.layers == (1, 2)  # layer 0 is dense (first_k_dense_replace=1)
        assert t.info(1).step_offsets == (0, 20, 22, 24)
        assert t.meta.router.router_score_normalization == "sigmoid" and t.meta.router.route_scale == 2.5
        assert t.info(1).has_bias and t.info(1).has_recorded_weights
        assert "glm4_moe" in t.meta.extra["capture"] and "UTF-8 bytes" in t.meta.provenance


@pytest.mark.parametrize("arch, kernel", [
    # each family capture hf records, replayed through the command line: by the tiled kernel where it routes the
    # family's semantics, by the reference (a --kernel of the seed's signature that routes them all) elsewhere
    ("deepseek_v3", "routetool_kernels.reference:musespark1x_routing_reference"),  # 8 groups, the best 4
    ("deepseek_v2", "routetool_kernels.reference:musespark1x_routing_reference"),  # not renormalised
    ("qwen2_moe", "routetool_kernels.reference:musespark1x_routing_reference"),    # norm_topk_prob false
    ("olmoe", "routetool_kernels.reference:musespark1x_routing_reference"),        # norm_topk_prob false
    ("gpt_oss", "routetool_kernels.reference:musespark1x_routing_reference"),      # softmax over the top-k logits
    ("qwen3_next", "tiled"),                                                        # softmax, renormalised
])
def test_capture_hf_records_each_family_and_replay_passes(tmp_path, arch, kernel):
    pytest.importorskip("transformers")
    from routetool.cli import main

    out = tmp_path / f"{arch}.safetensors"
    res = _run("capture", "hf", "--arch", arch, "--text", TEXT, "-o", out, *HF_SMALL)
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["replay", str(out), "--device", "cpu", "--kernel", kernel, "--no-latency",
                                    "--no-progress", "--json", "-"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    assert doc["verdict"] == "pass" and doc["totals"]["kernel_vs_reference"]["ok"]
    recorded = doc["totals"]["reference_vs_recorded"]  # the model's own routing = the reference's
    assert recorded["rows"] > 0 and recorded["mismatch"] == 0 and recorded["invalid"] == 0


def test_capture_hf_reads_stdin_and_a_config_file(tmp_path):
    pytest.importorskip("transformers")
    from routetool.capture.hf import small_config

    config = tmp_path / "config.json"
    small_config("mixtral", hidden_size=32, intermediate_size=64).to_json_file(config)
    out = tmp_path / "m.safetensors"
    res = _run("capture", "hf", "--config", config, "--text", "-", "-o", out, "--batch", "1", "--prompt-tokens",
               "8", "--max-new-tokens", "0", input="Call me Ishmael. Some years ago")
    assert res.exit_code == 0, res.output
    with open_trace(out) as t:
        assert t.meta.router.num_experts == 8 and t.info(0).step_offsets == (0, 8)
        assert "<stdin>" in t.meta.provenance


def _tiny_checkpoint(path, seed=4):
    from routetool.capture.hf import build_model, small_config

    model = build_model(small_config("qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16),
                        seed=seed)
    model.save_pretrained(path)
    return model


def test_capture_hf_from_a_local_checkpoint(tmp_path):
    pytest.importorskip("transformers")
    from routetool.capture.hf import capture_hf, encode_text, prompt_batch

    ckpt = tmp_path / "ckpt"
    model = _tiny_checkpoint(ckpt)
    out = tmp_path / "q.safetensors"
    res = _run("capture", "hf", "--model", ckpt, "--text", TEXT, "-o", out, "--batch", "2", "--prompt-tokens", "6",
               "--max-new-tokens", "2")
    assert res.exit_code == 0, res.output
    # the checkpoint's weights were loaded: the in-memory model on the same input records the same trace
    ids = prompt_batch(encode_text(TEXT.read_text(), None, 256), 2, 6)
    _, expected = capture_hf(model, ids, max_new_tokens=2, model_name="m", provenance="p")
    with open_trace(out) as t:
        assert t.meta.model == str(ckpt) and t.meta.router.router_score_normalization == "softmax"
        assert "UTF-8 bytes" in t.meta.provenance  # no tokenizer files in the folder: byte fallback
        assert t.layers == tuple(sorted(expected))
        for layer in t.layers:
            rows = t.read_rows(layer, 0, t.info(layer).num_tokens)
            assert t.info(layer).step_offsets == (0, 12, 14)
            torch.testing.assert_close(rows.gating_output, expected[layer].gating_output, rtol=1e-6, atol=1e-6)
            assert torch.equal(rows.recorded_ids, expected[layer].topk_ids)


def test_capture_hf_sets_a_checkpoint_config_field_before_its_weights_load(tmp_path):
    # --set was refused with --model: a checkpoint's router semantics could not be changed without editing it
    pytest.importorskip("transformers")
    ckpt = tmp_path / "ckpt"
    _tiny_checkpoint(ckpt)
    out = tmp_path / "q.safetensors"
    base = ["capture", "hf", "--model", ckpt, "--text", TEXT, "--batch", "2", "--prompt-tokens", "6",
            "--max-new-tokens", "2"]
    res = _run(*base, "-o", out, "--set", "norm_topk_prob=false")
    assert res.exit_code == 0, res.output
    with open_trace(out) as t:
        assert t.meta.router.norm_topk_prob is False and t.meta.extra["weights_semantics"] == "unnormalized"
        assert "with norm_topk_prob=false" in t.meta.provenance
        step = next(t.steps(t.layers[0]))
        assert (step.recorded_weights.float().sum(-1) < 0.999).all()  # the model's raw top-k probabilities
    # the checkpoint's own config is untouched; an impossible router is refused naming the checkpoint and --set
    assert json.loads((ckpt / "config.json").read_text())["norm_topk_prob"] is True
    _one_line_error(_run(*base, "-o", tmp_path / "x.safetensors", "--set", "num_experts_per_tok=99"),
                    f"{ckpt} --set num_experts_per_tok=99", "num_experts_per_tok=99 must be an integer in [1, ")


def test_capture_hf_uses_the_checkpoint_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    ckpt = tmp_path / "ckpt"
    _tiny_checkpoint(ckpt)
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=256,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["it was the best of times"], trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(ckpt)
    out = tmp_path / "q.safetensors"
    args = ["capture", "hf", "--model", ckpt, "--text", TEXT, "-o", out, "--batch", "1", "--prompt-tokens", "5",
            "--max-new-tokens", "1"]
    res = _run(*args)
    assert res.exit_code == 0, res.output
    with open_trace(out) as t:
        assert "checkpoint tokenizer" in t.meta.provenance
    # broken tokenizer files are an error with the way out, not a silent fallback
    (ckpt / "tokenizer.json").write_text("{broken")
    _one_line_error(_run(*args, "--force"), "cannot load the checkpoint's tokenizer", "--tokenizer bytes")
    assert _run(*args, "--force", "--tokenizer", "bytes").exit_code == 0


@pytest.mark.parametrize("args, fragments", [
    ([], ["give exactly one of --model, --config, --arch (got none)"]),
    (["--arch", "mixtral", "--config", "c.json"], ["got --config, --arch"]),
    (["--arch", "deepseek_v3", "--set", "n_group=5", "--set", "topk_group=2"],
     ["n_group=5 must divide num_experts=32 into equal groups"]),
    (["--arch", "deepseek_v2", "--set", "topk_method=\"sparse\"", "--set", "n_group=8",
      "--set", "topk_group=3"], ["topk_method='sparse' must be greedy or group_limited_greedy"]),
    (["--arch", "mixtral", "--prompt-tokens", "100000"], ["the text has", "need 400000"]),
    (["--arch", "mixtral", "--set", "oops"], ["--set 'oops' is not KEY=VALUE"]),
    # values are JSON: one that is not was taken as a string
    (["--arch", "mixtral", "--set", "x=notjson"],
     ["--set x: the value 'notjson' is not JSON (write a number, true, false, null or a quoted string, e.g. "
      "--set 'x=\"notjson\"')"]),
    (["--arch", "mixtral", "--set", "hidden_size=6x4"], ["--set hidden_size: the value '6x4' is not JSON"]),
    (["--arch", "mixtral", "--set", "norm_topk_prob="], ["--set norm_topk_prob: the value '' is not JSON"]),
    # a key given twice: the last value won silently
    (["--arch", "deepseek_v3", "--set", "n_routed_experts=64", "--set", "n_routed_experts=32"],
     ["--set n_routed_experts is given twice ('64', then '32') (give each key once, e.g. --set n_routed_experts=32)"]),
    (["--arch", "mixtral", "--set", "head_dim=16", "--set", " head_dim =16"], ["--set head_dim is given twice"]),
    (["--model", "no/such/dir"], ["is not a checkpoint folder"]),
    (["--config", "missing.json"], ["no such config file"]),
    (["--model", ".", "--router-std", "1"], ["--router-std and --bias-std apply to random-weight models"]),
])
def test_capture_hf_bad_input_exit_2(tmp_path, args, fragments):
    pytest.importorskip("transformers")
    out = tmp_path / "o.safetensors"
    _one_line_error(_run("capture", "hf", "--text", TEXT, "-o", out, *args), *fragments)
    assert not out.exists()


def test_capture_hf_unsupported_config(tmp_path):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1}))
    _one_line_error(_run("capture", "hf", "--config", config, "--text", TEXT, "-o", tmp_path / "o.safetensors"),
                    "model_type 'llama' is not supported", "deepseek_v3")


def test_capture_hf_refuses_existing_output_before_loading(tmp_path):
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"precious")
    _one_line_error(_run("capture", "hf", "--arch", "mixtral", "--text", TEXT, "-o", out), "already exists")
    assert out.read_bytes() == b"precious"


# ---------------------------------------------------------------------------------------
# outputs: '-' is not a file; --output (with --out kept as an alias)
@pytest.mark.parametrize("flag", ["-o", "--output", "--out"])
def test_synth_refuses_stdout_as_its_output(tmp_path, monkeypatch, flag):
    monkeypatch.chdir(tmp_path)
    _one_line_error(_run("synth", flag, "-", *SMALL), "'-' (stdout) cannot take this output", "name a file")
    assert list(tmp_path.iterdir()) == []  # no file literally named '-'


@pytest.mark.parametrize("flag", ["--output", "--out"])
def test_synth_output_option_and_its_alias(tmp_path, flag):
    out = tmp_path / "s.safetensors"
    res = _run("synth", flag, out, *SMALL)
    assert res.exit_code == 0, res.output
    assert f"wrote {out}" in res.output and out.is_file()


def test_capture_hf_refuses_stdout_and_its_own_input_as_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _one_line_error(_run("capture", "hf", "--arch", "mixtral", "--text", TEXT, "--output", "-"),
                    "'-' (stdout) cannot take this output")
    assert list(tmp_path.iterdir()) == []
    text = tmp_path / "t.txt"
    text.write_text(TEXT.read_text())
    _one_line_error(_run("capture", "hf", "--arch", "mixtral", "--text", text, "--out", text, "--force"),
                    "is this run's input")
    assert text.read_text() == TEXT.read_text()


def test_info_json_refuses_the_trace_and_its_shards(tmp_path):
    from routetool.io.sharded import write_index

    trace = tmp_path / "t.safetensors"
    assert _run("synth", "-o", trace, *SMALL).exit_code == 0
    before = trace.read_bytes()
    _one_line_error(_run("info", trace, "--json", trace, "--force"), "is this run's input")
    index = tmp_path / "run.json"
    write_index(index, [{"path": trace.name}], complete=True, stopped_by="exit")
    _one_line_error(_run("info", index, "--json", trace, "--force"), "is this run's input")
    assert trace.read_bytes() == before


# ---------------------------------------------------------------------------------------
# synth: impossible numbers fail fast, in one line
@pytest.mark.parametrize("args, fragments", [
    (["--padding", "fraction:0.999999"], ["logits; the limit is 2**28", "per layer"]),
    (["--prefill", "999999999999"], ["1,000,000,000,004 rows x 48 experts", "the limit is 2**28"]),
    (["--seed", "99999999999999999999"], ["--seed", "0<=x<=9223372036854775807"]),
    (["--seed", "-1"], ["--seed"]),
    (["--experts", "100000", "--prefill", "1", "--decode-steps", "0"], ["--experts", "1<=x<=65536"]),
    (["--experts", "65536", "--topk", "8", "--layers", "4", "--skew", "imbalance:3", "--prefill", "1",
      "--decode-steps", "0"], ["logit evaluations", "the limit is 2**34"]),
    (["--decode-steps", "100000000"], ["--decode-steps", "0<=x<=1000000"]),
    (["--skew", "zipf:nan"], ["--skew 'zipf:nan': arguments must be finite numbers"]),
    (["--skew", "imbalance:nan"], ["finite numbers"]),
    (["--skew", "imbalance:inf"], ["finite numbers"]),
    (["--skew", "imbalance:3:nan"], ["finite numbers"]),
    (["--skew", "imbalance:9"], ["at most experts/topk = 8"]),
    (["--bias-rate", "nan"], ["bias_update_rate=nan (--bias-rate)"]),
    (["--bias-rate", "inf"], ["(--bias-rate) must be a finite number in [0, 1]"]),
    (["--route-scale", "nan"], ["route_scale=nan must be finite"]),
    (["--multiplier", "inf"], ["router_output_multiplier must be finite"]),
    (["--eps", "nan"], ["router_score_division_eps=nan"]),
    (["--affinity", "nan"], ["--affinity 'nan' must be auto or a finite number in [0, 10]"]),
    (["--affinity", "11"], ["--affinity '11'"]),
    (["--ties", "1000000"], ["--ties"]),
])
def test_synth_impossible_numbers_exit_2(tmp_path, args, fragments):
    out = tmp_path / "s.safetensors"
    _one_line_error(_run("synth", "-o", out, *SMALL, *args), *fragments)
    assert not out.exists()


def test_synth_prints_targets_and_warns_about_unreachable_ones(tmp_path):
    out = tmp_path / "s.safetensors"
    args = ["--layers", "2", "--prefill", "2048", "--decode-steps", "0", "--ties", "0"]
    res = _run("synth", "-o", out, *args, "--skew", "imbalance:1.5:0")
    assert res.exit_code == 0, res.output
    assert "target" in res.stdout and "affinity" in res.stdout and "routetool: warning" not in res.stderr
    res = _run("synth", "-o", out, *args, "--skew", "imbalance:1.05:0", "--force")
    assert res.exit_code == 0, res.output
    warnings = [line for line in res.stderr.splitlines() if line.startswith("routetool: warning:")]
    assert len(warnings) == 1 and "layers 0, 1: imbalance target 1.05 is below the lowest level" in warnings[0]
    assert "(!)" in res.stdout


# ---------------------------------------------------------------------------------------
# info: non-regular files
def test_info_on_a_fifo_fails_at_once(tmp_path):
    import os

    fifo = tmp_path / "trace.safetensors"
    os.mkfifo(fifo)
    _one_line_error(_run("info", fifo), "trace.safetensors: is not a regular file")
    index = tmp_path / "run.json"
    os.mkfifo(index)
    _one_line_error(_run("info", index), "run.json: is not a regular file")


# ---------------------------------------------------------------------------------------
# capture hf: impossible configs and options, bad text files
@pytest.mark.parametrize("args, fragments", [
    (["--arch", "mixtral", "--set", "num_experts_per_tok=9"],
     ["--arch mixtral --set num_experts_per_tok=9: num_experts_per_tok=9 must be an integer in [1, "
      "num_local_experts=8]"]),
    (["--arch", "mixtral", "--set", "num_experts_per_tok=-1"], ["num_experts_per_tok=-1 must be"]),
    (["--arch", "mixtral", "--set", "num_local_experts=0"], ["num_local_experts=0 must be an integer >= 1"]),
    (["--arch", "mixtral", "--set", "num_local_experts=1"], ["num_experts_per_tok=2 must be an integer in [1, "
                                                             "num_local_experts=1]"]),
    (["--arch", "mixtral", "--set", "num_local_experts=\"x\""], ["--arch mixtral", "num_local_experts", "expected int"]),
    (["--arch", "mixtral", "--set", "hidden_size=-1"], ["hidden_size=-1 must be an integer >= 1"]),
    (["--arch", "qwen3_moe", "--set", "num_experts=2"], ["num_experts_per_tok=4 must be an integer in [1, "
                                                         "num_experts=2]"]),
    (["--arch", "qwen3_moe", "--set", "norm_topk_prob=\"no\""], ["norm_topk_prob"]),
    (["--arch", "deepseek_v3", "--set", "routed_scaling_factor=-1.0"], ["routed_scaling_factor=-1.0 must be"]),
    (["--arch", "mixtral", "--set", "num_attention_heads=3"], ["--arch mixtral --set num_attention_heads=3: ",
                                                               "the model failed to run (RuntimeError"]),
    (["--arch", "mixtral", "--seed", "99999999999999999999"], ["--seed", "0<=x<=9223372036854775807"]),
    (["--arch", "mixtral", "--router-std", "nan"], ["--router-std nan must be a finite number in [0, 10]"]),
    (["--arch", "mixtral", "--router-std", "-1"], ["--router-std -1.0 must be"]),
    (["--arch", "deepseek_v3", "--bias-std", "nan"], ["--bias-std nan must be"]),
    (["--arch", "deepseek_v3", "--bias-std", "inf"], ["--bias-std inf must be"]),
    # the example names each option's own default (--bias-std said 0.25, --router-std's)
    (["--arch", "deepseek_v3", "--bias-std", "-1"], ["(e.g. --bias-std 0.02, the default; 0 keeps HF's"]),
    (["--arch", "deepseek_v3", "--router-std", "11"], ["(e.g. --router-std 0.25, the default; 0 keeps HF's"]),
    # every layer dense: it said "no router modules found in DeepseekV3ForCausalLM (the model must be a
    # supported transformers MoE model)", naming neither the config nor the cause
    (["--arch", "kimi_k2", "--set", "first_k_dense_replace=5"],
     ["--arch kimi_k2 --set first_k_dense_replace=5: DeepseekV3ForCausalLM has no MoE layer: every decoder layer is "
      "dense (num_hidden_layers=3, first_k_dense_replace=5) (leave at least one layer sparse"]),
    (["--arch", "mixtral", "--batch", "60000", "--prompt-tokens", "100000"], ["logits; the limit is 2**30"]),
    # models too large to build: the process used to be killed for memory
    (["--arch", "deepseek_v3", "--set", "num_hidden_layers=100000"],
     ["--arch deepseek_v3 --set num_hidden_layers=100000: num_hidden_layers=100,000 is above the limit of 1,024 layers "
      "for a random-weight model (fix num_hidden_layers in the config (or --set num_hidden_layers=...))"]),
    (["--arch", "mixtral", "--set", "vocab_size=10000000"],
     ["--arch mixtral --set vocab_size=10000000: the model would hold 1,280,", "GiB in float32;",
      "(lower num_hidden_layers, hidden_size, the intermediate sizes, the expert count or vocab_size "
      "(--set KEY=VALUE), or use --dtype bfloat16)"]),
])
def test_capture_hf_impossible_configs_exit_2(tmp_path, args, fragments):
    pytest.importorskip("transformers")
    out = tmp_path / "o.safetensors"
    _one_line_error(_run("capture", "hf", "--text", TEXT, "-o", out, *args), *fragments)
    assert not out.exists()


def test_capture_hf_config_file_with_topk_above_its_experts(tmp_path):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 6,
                                  "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 256}))
    _one_line_error(_run("capture", "hf", "--config", config, "--text", TEXT, "-o", tmp_path / "o.safetensors"),
                    f"{config}: num_experts_per_tok=6 must be an integer in [1, num_local_experts=4]")


@pytest.mark.parametrize("make, fragments", [
    (lambda p: p / "missing.txt", ["missing.txt: no such file", "UTF-8 text file"]),
    (lambda p: p, ["is a directory, not a text file"]),
    (lambda p: (p / "b.txt").write_bytes(b"ok \xff\xfe bytes") and p / "b.txt", ["b.txt: is not UTF-8 text (byte 3"]),
    (lambda p: (p / "e.txt").write_text(" \n") and p / "e.txt", ["e.txt: the text is empty"]),
])
def test_capture_hf_bad_text_file_is_one_line(tmp_path, make, fragments):
    text = make(tmp_path)
    _one_line_error(_run("capture", "hf", "--arch", "mixtral", "--text", text, "-o", tmp_path / "o.safetensors"),
                    *fragments)


def test_capture_hf_empty_stdin_is_one_line(tmp_path):
    _one_line_error(_run("capture", "hf", "--arch", "mixtral", "--text", "-", "-o", tmp_path / "o.safetensors",
                         input=""), "<stdin>: the text is empty")


@pytest.mark.parametrize("flag, shown", [("--no-progress", False), ("--progress", True)])
def test_capture_hf_no_progress_silences_transformers_bars(tmp_path, monkeypatch, flag, shown):
    # transformers drew its "Loading weights" bar under --no-progress
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    import routetool.capture.hf as hf

    ckpt = tmp_path / "ckpt"
    _tiny_checkpoint(ckpt)
    seen = []
    load = hf.load_checkpoint
    monkeypatch.setattr(hf, "load_checkpoint", lambda *a, **k: (seen.append(hf_logging.is_progress_bar_enabled()),
                                                                load(*a, **k))[1])
    res = _run("capture", "hf", "--model", ckpt, "--text", TEXT, "-o", tmp_path / "q.safetensors", "--batch", "1",
               "--prompt-tokens", "4", "--max-new-tokens", "0", flag)
    assert res.exit_code == 0, res.output
    assert seen == [shown] and hf_logging.is_progress_bar_enabled()  # restored afterwards
