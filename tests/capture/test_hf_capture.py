"""HF transformers hooks (routetool.capture.hf) on tiny seeded models of every supported family.

Each test runs the model's own router code, records it, and replays the trace: the
reference must reproduce the model's routing (ids up to ties, weights within tolerance).
"""

import pytest
import torch

pytest.importorskip("transformers")

from routetool.capture.hf import (  # noqa: E402
    HFRouterRecorder,
    build_model,
    capture_hf,
    encode_text,
    load_config,
    prompt_batch,
    router_config_for,
    small_config,
)
from routetool.errors import RouteToolError  # noqa: E402
from routetool.io.trace import open_trace, write_trace  # noqa: E402
from conftest import DEVICE

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 2
BATCH, PROMPT, NEW = 2, 12, 4  # 1 prefill step of 24 rows + 3 decode steps of 2 rows
TINY = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16)


def _capture(tmp_path, arch, dtype=torch.float32, seed=0, **overrides):
    model = build_model(small_config(arch, **TINY, **overrides), seed=seed, dtype=dtype)
    ids = prompt_batch(encode_text(TEXT, None, model.config.vocab_size), BATCH, PROMPT)
    meta, layers = capture_hf(model, ids, max_new_tokens=NEW, model_name=f"tiny {arch}", provenance="test")
    path = write_trace(tmp_path / f"{arch}.safetensors", meta, layers)
    return model, path


REFERENCE_KERNEL = "routetool_kernels.reference:musespark1x_routing_reference"
"""The kernel that routes every semantics (the MuseSpark1x kernels reject those beyond the seed's)."""


def _replay(path, kernel=None):
    """Replay ``path`` with ``kernel``; by default the tiled kernel, or the reference where the trace's router
    asks semantics beyond the seed's (which the tiled kernel rejects, as documented)."""
    from routetool.engine.execution import load_kernel, select_execution
    from routetool.analysis.replay import replay_trace

    with open_trace(path) as t:
        kernel = kernel or (REFERENCE_KERNEL if t.meta.router.beyond_seed() else "tiled")
        name, fn = load_kernel(kernel)
        execution = select_execution(DEVICE.type).for_kernel(fn)
        return replay_trace(t, name, fn, execution, measure_latency=False)


def _assert_replay_matches_model(result, rows_per_layer):
    for layer in result.layers:
        rec = layer.reference_vs_recorded
        assert rec is not None and rec.rows == rows_per_layer
        # the model's own routing = the reference's, up to tie-equivalent rows
        assert rec.mismatch == 0 and rec.invalid == 0, rec.failures
        assert rec.exact + rec.reordered + rec.tie_equivalent == rows_per_layer
        assert rec.weight_rows_over_tolerance == 0, rec.failures
        assert layer.kernel_vs_reference.ok


@pytest.mark.parametrize("arch, normalization, has_bias, num_experts, route_scale, beyond", [
    # sigmoid + e_score_correction_bias, renormalised, x2.5, and DeepSeek-V3's real groups: 8, the best 4
    ("deepseek_v3", "sigmoid", True, 32, 2.5, ["n_group"]),
    ("glm4_moe", "sigmoid", True, 32, 2.5, []),      # GLM-4.5: the same router in another model class, no groups
    ("kimi_k2", "sigmoid", True, 384, 2.827, []),    # Kimi-K2 shape through a DeepSeek-V3 config: E=384, top-8
    ("qwen3_moe", "softmax", False, 32, 1.0, []),    # softmax, norm_topk_prob=True (real Qwen3-MoE checkpoints)
    ("mixtral", "softmax", False, 8, 1.0, []),       # softmax, always renormalised, K=2 of 8
    ("qwen3_next", "softmax", False, 512, 1.0, []),  # Qwen3-Next / Qwen3.5: 512 experts, top-10, renormalised
    ("gpt_oss", "topk_then_softmax", False, 32, 1.0, ["topk_then_softmax"]),  # top-k of the logits, softmax
    # not renormalised: Qwen2-MoE's and OLMoE's configs, DeepSeek-V2 always (greedy: V2-Lite)
    ("qwen2_moe", "softmax", False, 60, 1.0, ["norm_topk_prob"]),
    ("olmoe", "softmax", False, 64, 1.0, ["norm_topk_prob"]),
    ("deepseek_v2", "softmax", False, 64, 1.0, ["norm_topk_prob"]),
])
def test_capture_and_replay_matches_the_model(tmp_path, arch, normalization, has_bias, num_experts, route_scale,
                                              beyond):
    model, path = _capture(tmp_path, arch)
    with open_trace(path) as t:
        r = t.meta.router
        assert (r.num_experts, r.router_score_normalization, r.route_scale) == (num_experts, normalization,
                                                                               pytest.approx(route_scale))
        assert r.beyond_seed() == beyond
        assert t.meta.extra["weights_semantics"] == ("unnormalized" if r.norm_topk_prob is False else "renormalized")
        assert len(t.layers) >= 2
        for layer in t.layers:
            info = t.info(layer)
            assert info.step_offsets == (0, BATCH * PROMPT, *(BATCH * PROMPT + BATCH * i for i in range(1, NEW)))
            assert info.has_recorded_ids and info.has_recorded_weights and info.gating_dtype == torch.float32
            assert info.has_bias == has_bias
            if has_bias:  # the model's own e_score_correction_bias, not zeros
                module = dict(model.named_modules())[f"model.layers.{layer}.mlp.gate"]
                assert torch.equal(t.bias(layer), module.e_score_correction_bias.float())
                assert t.bias(layer).abs().max() > 0
    _assert_replay_matches_model(_replay(path), BATCH * PROMPT + BATCH * (NEW - 1))


def test_bf16_model_records_bf16_logits_and_weights(tmp_path):
    # Qwen3-MoE computes logits and casts the weights in the model dtype: both are recorded as
    # they were, so that replay's tolerance matches their rounding (and bf16 ties show up as ties)
    _, path = _capture(tmp_path, "qwen3_moe", dtype=torch.bfloat16)
    with open_trace(path) as t:
        step = next(t.steps(t.layers[0]))
        assert step.gating_output.dtype == torch.bfloat16 and step.recorded_weights.dtype == torch.bfloat16
    _assert_replay_matches_model(_replay(path), BATCH * PROMPT + BATCH * (NEW - 1))


def test_unnormalized_softmax_weights_are_labelled_and_ids_match(tmp_path):
    _, path = _capture(tmp_path, "qwen3_moe", norm_topk_prob=False)
    with open_trace(path) as t:
        assert t.meta.extra["weights_semantics"] == "unnormalized" and t.meta.router.norm_topk_prob is False
        assert t.meta.router.route_scale == 1.0 and t.meta.router.router_score_division_eps is None
        step = next(t.steps(t.layers[0]))
        # raw top-k probabilities: rows sum to less than 1
        assert (step.recorded_weights.sum(-1) < 0.999).all()
    result = _replay(path)
    for layer in result.layers:
        rec = layer.reference_vs_recorded
        assert rec.mismatch == 0 and rec.invalid == 0  # the picks agree whatever the weights mean


def test_unnormalized_softmax_weights_replay_like_with_like(tmp_path):
    # replay compares the recorded raw top-k probabilities with the reference's unbiased
    # scores of its picks (x route_scale), not with its renormalised weights
    _, path = _capture(tmp_path, "qwen3_moe", norm_topk_prob=False)
    result = _replay(path)
    assert result.weights_semantics == "unnormalized"
    _assert_replay_matches_model(result, BATCH * PROMPT + BATCH * (NEW - 1))
    for layer in result.layers:
        rec = layer.reference_vs_recorded
        assert rec.weight_rtol is not None and rec.weight_max_rel_err < 1e-5  # weights were compared
    assert result.ok


def test_recorder_steps_follow_forward_passes():
    model = build_model(small_config("mixtral", **TINY), seed=1)
    ids = prompt_batch(encode_text(TEXT, None, 256), 3, 5)
    with HFRouterRecorder(model) as rec, torch.no_grad():
        model(input_ids=ids)
        model(input_ids=ids[:, :2])
    meta, layers = rec.trace(model_name="m", provenance="p")
    assert rec.num_steps == 2
    for arrays in layers.values():
        assert arrays.step_offsets.tolist() == [0, 15, 21]
        assert arrays.topk_ids.dtype == torch.int32
    # hooks are removed on exit
    model(input_ids=ids)
    assert rec.num_steps == 2


def test_group_limited_routing_is_recorded_and_its_groups_hold_every_pick(tmp_path):
    model, path = _capture(tmp_path, "deepseek_v3")
    with open_trace(path) as t:
        r = t.meta.router
        assert (r.n_group, r.topk_group, r.router_score_division_eps) == (8, 4, 1e-20)
        for layer in t.layers:
            ids = torch.cat([s.recorded_ids for s in t.steps(layer)]).long()
            assert all(len(set(row)) <= 4 for row in (ids // 4).tolist())  # 4 of the 8 groups of 4 experts
    # the model's groups change its picks: a router without them would not reproduce it
    with open_trace(path) as t:
        from dataclasses import replace

        from routetool_kernels.reference import route

        layer = t.layers[0]
        rows = t.read_rows(layer, 0, t.info(layer).num_tokens)
        plain = route(rows.gating_output, t.bias(layer), replace(t.meta.router, n_group=None, topk_group=None))[1]
        recorded = torch.cat([s.recorded_ids for s in t.steps(layer)])
        assert (plain.sort(-1).values != recorded.sort(-1).values).any(-1).sum() > 0
    # the tiled kernel rejects the groups as it documents: replay says so and exits 2
    from routetool.errors import KernelRejection

    with pytest.raises(KernelRejection, match="n_group"):
        _replay(path, "tiled")


def test_deepseek_v2_group_limited_greedy_is_recorded_with_its_group_score(tmp_path):
    # DeepSeek-V2 as configured: 8 groups by their best score, the best 3
    _, path = _capture(tmp_path, "deepseek_v2", topk_method="group_limited_greedy", n_group=8, topk_group=3)
    with open_trace(path) as t:
        r = t.meta.router
        assert (r.n_group, r.topk_group, r.topk_method, r.norm_topk_prob) == (8, 3, "group_limited_greedy", False)
    _assert_replay_matches_model(_replay(path), BATCH * PROMPT + BATCH * (NEW - 1))
    with pytest.raises(RouteToolError, match=r"topk_method='sparse' must be greedy or group_limited_greedy"):
        router_config_for(small_config("deepseek_v2", **TINY, topk_method="sparse", n_group=8, topk_group=3))


def test_unsupported_model_is_refused():
    from transformers import AutoConfig

    with pytest.raises(RouteToolError, match="model_type 'llama' is not supported"):
        router_config_for(AutoConfig.for_model("llama"))
    with pytest.raises(RouteToolError, match="unknown --arch"):
        small_config("gpt2")


def test_byte_fallback_tokenizer_and_prompt_batch():
    assert encode_text("Aé", None, 256) == [65, 0xC3, 0xA9]
    assert encode_text("Aé", None, 100) == [65, 0xC3 % 100, 0xA9 % 100]
    batch = prompt_batch(list(range(10)), 2, 4)
    assert batch.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(RouteToolError, match="the text has 10 tokens; 3 prompts of 4 need 12"):
        prompt_batch(list(range(10)), 3, 4)


def test_seeded_models_are_deterministic(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, a = _capture(tmp_path / "a", "glm4_moe", seed=5)
    _, b = _capture(tmp_path / "b", "glm4_moe", seed=5)
    with open_trace(a) as ta, open_trace(b) as tb:
        for layer in ta.layers:
            n = ta.info(layer).num_tokens
            sa, sb = ta.read_rows(layer, 0, n), tb.read_rows(layer, 0, n)
            assert torch.equal(sa.gating_output, sb.gating_output) and torch.equal(sa.recorded_ids, sb.recorded_ids)


# ---------------------------------------------------------------------------------------
# impossible configs are refused before the model is built; failures of the model code are one line
@pytest.mark.parametrize("arch, overrides, message", [
    ("mixtral", dict(num_experts_per_tok=9), r"num_experts_per_tok=9 must be an integer in \[1, num_local_experts=8\]"),
    ("mixtral", dict(num_experts_per_tok=-1), "num_experts_per_tok=-1"),
    ("mixtral", dict(num_local_experts=0), "num_local_experts=0 must be an integer >= 1"),
    ("mixtral", dict(num_local_experts=1), r"num_experts_per_tok=2 must be an integer in \[1, num_local_experts=1\]"),
    ("qwen3_moe", dict(num_experts=3), r"num_experts_per_tok=4 must be an integer in \[1, num_experts=3\]"),
    ("deepseek_v3", dict(n_routed_experts=2), r"\[1, n_routed_experts=2\]"),
    ("deepseek_v3", dict(routed_scaling_factor=0.0), "routed_scaling_factor=0.0 must be a finite number > 0"),
    ("mixtral", dict(hidden_size=-1), "hidden_size=-1 must be an integer >= 1"),
    ("mixtral", dict(vocab_size=0), "vocab_size=0 must be an integer >= 1"),
])
def test_impossible_router_configs_are_refused(arch, overrides, message, monkeypatch):
    import transformers

    def no_build(*a, **k):
        raise AssertionError("the config must be refused before the model is built")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", no_build)
    config = small_config(arch, **{**TINY, **overrides})
    with pytest.raises(RouteToolError, match=message):
        build_model(config, source="--arch test")


def test_config_type_errors_are_one_line():
    with pytest.raises(RouteToolError) as info:
        small_config("mixtral", num_local_experts="x")
    assert "\n" not in str(info.value) and "num_local_experts" in str(info.value)


def test_config_file_with_a_key_twice_is_refused(tmp_path):
    # json.loads kept the last value silently
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "mixtral", "num_local_experts": 8, "num_local_experts": 4}')
    with pytest.raises(RouteToolError, match="the key 'num_local_experts' appears twice in one object") as info:
        load_config(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_bad_seed_and_std_are_refused():
    config = small_config("mixtral", **TINY)
    for kw, message in ((dict(seed=2**64), r"seed=.* \[0, 2\*\*63-1\]"), (dict(seed=-1), "seed=-1"),
                        (dict(router_std=float("nan")), "--router-std nan"), (dict(bias_std=-0.5), "--bias-std -0.5"),
                        (dict(router_std=float("inf")), "--router-std inf")):
        with pytest.raises(RouteToolError, match=message):
            build_model(config, **kw)


def test_model_failures_while_running_are_one_line():
    model = build_model(small_config("mixtral", **TINY), seed=0)
    ids = torch.full((1, 4), 300)  # outside the 256-token vocabulary: the embedding fails
    with pytest.raises(RouteToolError, match=r"--arch x: the model failed to run \(IndexError"):
        capture_hf(model, ids, max_new_tokens=1, model_name="m", provenance="p", source="--arch x")


def test_capture_progress_counts_forward_passes():
    model = build_model(small_config("mixtral", **TINY), seed=0)
    ids = prompt_batch(encode_text(TEXT, None, 256), 2, 5)
    done = []
    capture_hf(model, ids, max_new_tokens=NEW, model_name="m", provenance="p", progress=done.append)
    assert sum(done) == NEW


@pytest.mark.parametrize("arch, overrides, semantics", [
    ("deepseek_v3", {}, "renormalized"),
    ("deepseek_v3", dict(norm_topk_prob=False), "unnormalized"),
    ("qwen3_moe", dict(norm_topk_prob=False), "unnormalized"),
    ("mixtral", {}, "renormalized"),
])
def test_weights_semantics_are_documented_values(arch, overrides, semantics):
    from routetool.io.trace import WEIGHTS_SEMANTICS

    _, _, got = router_config_for(small_config(arch, **TINY, **overrides))
    assert got == semantics and got in WEIGHTS_SEMANTICS


def test_read_text_errors(tmp_path):
    from routetool.capture.hf import read_text

    (tmp_path / "ok.txt").write_text("héllo")
    assert read_text(tmp_path / "ok.txt") == "héllo"
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    (tmp_path / "empty.txt").write_text("")
    for path, message in ((tmp_path / "missing.txt", "no such file"), (tmp_path, "is a directory"),
                          (tmp_path / "bad.txt", "is not UTF-8 text"), (tmp_path / "empty.txt", "the text is empty")):
        with pytest.raises(RouteToolError, match=message):
            read_text(path)


# ---------------------------------------------------------------------------------------
# the model's size is bounded before it is built (it used to be built, and the process killed)
@pytest.mark.parametrize("arch", ["deepseek_v3", "kimi_k2", "glm4_moe", "qwen3_moe", "mixtral"])
def test_model_size_counts_what_build_model_builds(arch):
    from routetool.capture.hf import model_size

    config = small_config(arch, **TINY)
    model = build_model(config, seed=0, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert model_size(config, torch.bfloat16) == (params, nbytes)


@pytest.mark.parametrize("overrides, message", [
    # 100,000 layers of the small config: about 80 GB in float32
    (dict(num_hidden_layers=100_000), r"--arch test: num_hidden_layers=100,000 is above the limit of 1,024 layers"),
    # 10^7-token vocabulary: embedding + lm_head 1.28e9 parameters, 4.8 GiB in float32
    (dict(vocab_size=10_000_000), r"--arch test: the model would hold 1,28\d,\d{3},\d{3} parameters, 4\.\d GiB in "
                                  r"float32; .* is \d"),
    (dict(num_local_experts=100_000), r"the model would hold [\d,]+ parameters, \d+\.\d GiB in float32"),
])
def test_models_too_large_are_refused_before_they_are_built(overrides, message, monkeypatch):
    import transformers

    real = transformers.AutoModelForCausalLM.from_config

    def meta_only(*a, **k):  # the size may be counted on the meta device; nothing may be allocated
        assert torch.empty(0).device.type == "meta", "the model must be refused before it is built"
        return real(*a, **k)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", meta_only)
    with pytest.raises(RouteToolError, match=message):
        build_model(small_config("mixtral", **overrides), source="--arch test")


def test_the_size_limit_is_half_the_memory_on_a_small_machine(monkeypatch):
    from routetool.capture import hf

    assert hf.physical_memory_bytes() > 2**28  # this machine says (Linux: os.sysconf)
    config = small_config("mixtral", **TINY)
    _, nbytes = hf.model_size(config)
    monkeypatch.setattr(hf, "physical_memory_bytes", lambda: nbytes)  # half of it is too little
    assert hf.model_size_limit() == nbytes // 2
    with pytest.raises(RouteToolError, match=r"the model would hold [\d,]+ parameters, [\d.]+ MiB in float32; half "
                                             r"of this machine's memory is [\d.]+ MiB"):
        build_model(config, source="--arch test")
    monkeypatch.setattr(hf, "physical_memory_bytes", lambda: None)  # the system does not say: the fixed limit
    assert hf.model_size_limit() == hf.MAX_MODEL_BYTES == 2**32
    assert build_model(config, source="--arch test") is not None
