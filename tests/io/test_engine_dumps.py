"""What engines emit themselves, read by `routetool import` and `balance`: files written as the engines
write them (tests/dump_writers.py), imported into traces and read back (ids, layers, steps equal),
analysed directly by balance (expert counts equal), and damaged or unknown variants refused in one
line, exit code 2."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dump_writers import (
    npy_base64,
    routed_experts,
    sglang_generate,
    vllm_completion,
    write_flashinfer_workload,
    write_json,
    write_jsonl,
    write_mcore_ep_load,
    write_megatron_replay,
    write_sglang_distribution,
    write_vllm_npy,
)
from routetool_kernels.reference import musespark1x_routing_reference
from routetool.cli import main
from routetool.io.dumps import ImportOptions, detect_format, iter_steps, read_dump
from routetool.io.trace import Trace

DEFINITION = "moe_fp8_block_scale_ds_routing_topk2_ng1_kg1_e16_h7168_i2048"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_line_error(res, *words):
    assert res.exit_code == 2, res.output
    assert res.output.startswith("routetool: error:") and "Traceback" not in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    for w in words:
        assert w in res.output, res.output


def imported_trace(tmp_path, source, *options):
    out = tmp_path / "out.safetensors"
    res = run("import", source, "-o", out, *options)
    assert res.exit_code == 0, res.output
    return Trace(out)


def balance_counts(source, *options) -> dict[int, list[int]]:
    """balance's per-layer expert counts (its JSON), reading ``source`` directly."""
    res = run("balance", source, "--json", "-", "--no-progress", "--device", "cpu", "--ep-size", "2", "--no-eplb",
              *options)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    return {x["layer"]: x["expert_counts_assignments"] for x in doc["layers"]}


def counts(ids: np.ndarray, E: int) -> list[int]:
    return np.bincount(np.asarray(ids).reshape(-1).astype(np.int64), minlength=E).tolist()


# -- vLLM ------------------------------------------------------------------------------------
@pytest.mark.parametrize("E", [
    8,    # uint8: vLLM's dtype for at most 256 experts
    300,  # uint16 beyond
])
def test_vllm_npy_folder_round_trip(tmp_path, E):
    folder = tmp_path / "routed"
    folder.mkdir()
    a = routed_experts(5, 4, 2, E, dense=(0,), seed=1)  # layer 0 dense: all zeros, as vLLM leaves it
    b = routed_experts(3, 4, 2, E, dense=(0,), seed=2)
    assert a.dtype == (np.uint8 if E <= 256 else np.uint16)
    write_vllm_npy(folder / "req-0.npy", a)
    write_vllm_npy(folder / "req-1.npy", b)
    assert detect_format(folder) == "vllm"
    with imported_trace(tmp_path, folder, "--num-experts", E) as t:
        assert list(t.layers) == [1, 2, 3]  # the dense layer is left out
        for layer in (1, 2, 3):
            got = torch.cat([s.recorded_ids for s in t.steps(layer)])
            assert got.tolist() == np.concatenate([a[:, layer], b[:, layer]]).tolist()
            assert list(t.info(layer).step_offsets) == [0, 5, 8]  # one step per request
    got = balance_counts(folder, "--num-experts", E)
    assert got == {layer: counts(np.concatenate([a[:, layer], b[:, layer]]), E) for layer in (1, 2, 3)}


@pytest.mark.parametrize("chat", [False, True])
def test_vllm_openai_responses_round_trip_with_alignment(tmp_path, chat):
    a = routed_experts(4, 3, 2, 8, seed=3)
    b = routed_experts(2, 3, 2, 8, seed=4)
    c = routed_experts(3, 3, 2, 8, seed=5)
    path = write_jsonl(tmp_path / "responses.jsonl", [vllm_completion([a, None, b], chat=chat, request_id="cmpl-a"),
                                                     vllm_completion([c], chat=chat, request_id="cmpl-b")])
    assert detect_format(path) == "vllm"
    r = read_dump(path)
    assert r.step_labels == ["cmpl-a/0", "cmpl-a/2", "cmpl-b/0"]  # the aborted choice (None) is skipped
    steps = [s for s in iter_steps(r) if s.layer == 1]
    assert [s.positions.tolist() for s in steps] == [[0, 1, 2, 3], [0, 1], [0, 1, 2]]
    assert steps[1].topk_ids.tolist() == b[:, 1].tolist()
    with imported_trace(tmp_path, path) as t:
        assert torch.cat([s.recorded_ids for s in t.steps(2)]).tolist() == np.concatenate([a, b, c])[:, 2].tolist()
    single = write_json(tmp_path / "one.json", vllm_completion([a], chat=chat))
    assert balance_counts(single) == {layer: counts(a[:, layer], 8) for layer in range(3)}


# -- SGLang routed experts -----------------------------------------------------------------
def test_sglang_generate_responses_round_trip(tmp_path):
    a = routed_experts(6, 3, 2, 8, seed=6).astype(np.int32)  # prompt 4 + completion 3 - 1 tokens
    b = routed_experts(2, 3, 2, 8, seed=7).astype(np.int32)
    path = write_json(tmp_path / "generate.json", [sglang_generate(a, 4, "r1"), sglang_generate(b, 2, "r2")])
    assert detect_format(path) == "sglang-routed"
    one_line_error(run("import", path, "-o", tmp_path / "x.safetensors"), "its topk is not recorded",
                   "pass the model's --topk")
    with imported_trace(tmp_path, path, "--topk", 2) as t:
        for layer in range(3):
            assert torch.cat([s.recorded_ids for s in t.steps(layer)]).tolist() == \
                np.concatenate([a, b])[:, layer].tolist()
    assert read_dump(path, ImportOptions(topk=2)).step_labels == ["r1", "r2"]
    assert balance_counts(path, "--topk", 2) == {x: counts(np.concatenate([a, b])[:, x], 8) for x in range(3)}


@pytest.mark.parametrize("engine", ["vllm", "sglang-routed"])
def test_a_folder_of_json_responses_is_read_response_by_response(tmp_path, engine):
    # a folder of the servers' responses, one per .json file, was taken for a folder of traces
    # ("not a trace, not a run folder"), and read_vllm read only .npy files in a folder
    a = routed_experts(4, 3, 2, 8, seed=8)
    b = routed_experts(3, 3, 2, 8, seed=9)
    folder = tmp_path / "responses"
    folder.mkdir()
    for i, x in enumerate([a, b]):
        write_json(folder / f"r{i}.json", vllm_completion([x], request_id=f"cmpl-{i}") if engine == "vllm" else
                   sglang_generate(x.astype(np.int32), 2, f"r{i}"))
    assert detect_format(folder) == engine
    options = [] if engine == "vllm" else ["--topk", 2]
    assert balance_counts(folder, *options) == {x: counts(np.concatenate([a, b])[:, x], 8) for x in range(3)}
    with imported_trace(tmp_path, folder, *options) as t:
        assert len(list(t.steps(0))) == 2


# -- SGLang expert-distribution recorder ------------------------------------------------------
def _sglang_passes():
    """Two forward passes of 2 layers, physical ids (6 slots: E=4 + 2 replicas), -1 beyond topk=2."""
    ids = torch.full((2, 2, 3, 8), -1, dtype=torch.int32)
    ids[0, :, :, :2] = torch.tensor([[[0, 5], [4, 2], [1, 3]], [[4, 1], [5, 2], [0, 1]]])
    ids[1, :, :2, :2] = torch.tensor([[[3, 2], [2, 4]], [[0, 3], [1, 2]]])
    phys_map = torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 3, 3]])
    return [ids[0], ids[1, :, :2]], phys_map


def test_sglang_distribution_modes_agree(tmp_path):
    passes, phys_map = _sglang_passes()
    logical = [torch.gather(phys_map, 1, p.clamp(min=0).flatten(1).long()).view_as(p).masked_fill(p < 0, -1)
               for p in passes]
    expected = {layer: counts(torch.cat([x[layer][:, :2] for x in logical]).numpy(), 4) for layer in range(2)}
    files = {mode: write_sglang_distribution(tmp_path / f"expert_distribution_recorder_{mode}.pt", mode, passes,
                                             phys_map, [[5, 6, 7], [8, 9]]) for mode in ("per_token", "per_pass", "stat")}
    with imported_trace(tmp_path, files["per_token"]) as t:
        assert [s.recorded_ids.tolist() for s in t.steps(1)] == [x[1][:, :2].tolist() for x in logical]
    r = read_dump(files["per_token"])
    assert r.layers[0].positions.tolist() == [5, 6, 7, 8, 9]  # the records' positions
    for mode in ("per_token", "per_pass", "stat"):
        assert balance_counts(files[mode], "--topk", 2) == expected, mode
    for mode in ("per_pass", "stat"):
        one_line_error(run("import", files[mode], "-o", tmp_path / "x.safetensors"), "holds per-expert counts")


# -- Megatron RouterReplay ---------------------------------------------------------------------
@pytest.mark.parametrize("form", ["list", "stacked"])
def test_megatron_router_replay_round_trip(tmp_path, form):
    folder = tmp_path / "replay"
    folder.mkdir()
    steps = [torch.from_numpy(routed_experts(n, 3, 2, 8, seed=n).astype(np.int64)) for n in (4, 2)]
    for i, ids in enumerate(steps):
        write_megatron_replay(folder / f"replay_{i}.pt", ids, form)
    assert detect_format(folder) == "megatron" and detect_format(folder / "replay_0.pt") == "megatron"
    with imported_trace(tmp_path, folder, "--num-experts", 8) as t:
        assert list(t.layers) == [0, 1, 2] and list(t.info(0).step_offsets) == [0, 4, 6]
        for layer in range(3):
            assert [s.recorded_ids.tolist() for s in t.steps(layer)] == [x[:, layer].tolist() for x in steps]
    assert balance_counts(folder, "--num-experts", 8) == \
        {x: counts(torch.cat(steps)[:, x].numpy(), 8) for x in range(3)}


def test_megatron_router_replay_one_layer(tmp_path):
    ids = torch.from_numpy(routed_experts(5, 1, 2, 8, seed=9).astype(np.int64))
    path = write_megatron_replay(tmp_path / "replay.pt", ids, "tensor")  # the docs' torch.save(top_k_idx)
    with imported_trace(tmp_path, path) as t:
        assert list(t.layers) == [0] and torch.cat([s.recorded_ids for s in t.steps(0)]).tolist() == ids[:, 0].tolist()


# -- Megatron expert-load dumps ---------------------------------------------------------------
def test_mcore_ep_load_ranks_summed(tmp_path):
    folder = tmp_path / "mcore_ep_loads"
    folder.mkdir()
    rng = np.random.default_rng(0)
    loads = [rng.integers(0, 9, (2, 3, 8)) for _ in range(2)]
    loads[1][:, 2] = 12345  # beyond forward_counts of layer 3: the recorder's unwritten buffer, never read
    write_mcore_ep_load(folder / "mcore_ep_loads_rank0_20261201_235900_pid1000.npz", loads[0], [1, 3], [3, 3],
                        global_rank=0, ep_rank=0, ep_size=2)
    write_mcore_ep_load(folder / "mcore_ep_loads_rank1_20261201_235900_pid1001_partial.npz", loads[1], [1, 3],
                        [2, 2], global_rank=1, ep_rank=1, ep_size=2)
    assert detect_format(folder) == "megatron-ep-load"
    r = read_dump(folder)
    layer1 = loads[0][0].copy()
    layer1[:2] += loads[1][0, :2]
    assert r.layers[1].tolist() == layer1.tolist() and sorted(r.layers) == [1, 3]
    got = balance_counts(folder, "--topk", 2)
    assert got[1] == layer1.sum(0).tolist()
    one_line_error(run("import", folder, "-o", tmp_path / "x.safetensors"), "holds per-expert counts",
                   "routetool balance")


# -- FlashInfer-Trace -----------------------------------------------------------------------
def test_flashinfer_workloads_become_a_routable_trace(tmp_path):
    folder = tmp_path / "blob" / "workloads" / "moe" / DEFINITION
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(5, 16, generator=g), torch.randn(3, 16, generator=g)]
    bias = torch.randn(16, generator=g)
    for i, lg in enumerate(logits):
        write_flashinfer_workload(folder, DEFINITION, lg, bias, seed=i)
    assert detect_format(folder) == "flashinfer-trace"
    files = sorted(folder.iterdir())
    with imported_trace(tmp_path, folder) as t:
        assert t.meta.router.topk == 2 and t.meta.router.router_score_normalization == "sigmoid"
        assert t.info(0).has_logits and not t.info(0).has_recorded_ids
        stored = torch.cat([s.gating_output for s in t.steps(0)])
        expected_logits = torch.cat([_blob_logits(f) for f in files])  # one step per file, in name order
        assert torch.equal(stored, expected_logits)
        assert torch.equal(t.bias(0).float(), bias.to(torch.bfloat16).float())
    _, ids = musespark1x_routing_reference(expected_logits, bias.to(torch.bfloat16).float(), 2, 1.0)
    assert balance_counts(folder, "--reference") == {0: counts(ids.numpy(), 16)}
    # replay routes the imported trace with the kernel and compares it with the reference
    res = run("replay", tmp_path / "out.safetensors", "--no-latency", "--device", "cpu", "--json", "-",
              "--no-progress")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    totals = doc["totals"]["kernel_vs_reference"]
    assert (totals["rows"], totals["exact"], totals["mismatch"], totals["invalid"]) == (8, 8, 0, 0) and totals["ok"]


def test_a_grouped_flashinfer_workload_keeps_its_groups(tmp_path):
    # DeepSeek-V3's definition (ng8_kg4): the trace's router carries the groups, and the reference routes them
    definition = "moe_fp8_block_scale_ds_routing_topk4_ng4_kg2_e16_h7168_i2048"
    folder = tmp_path / "blob" / "workloads" / "moe" / definition
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(9, 16, generator=g), torch.randn(16, generator=g) * 0.1
    write_flashinfer_workload(folder, definition, logits, bias)
    with imported_trace(tmp_path, folder) as t:
        router = t.meta.router
        assert (router.n_group, router.topk_group, router.topk) == (4, 2, 4)
        stored = torch.cat([s.gating_output for s in t.steps(0)])
        stored_bias = t.bias(0).float()
    _, ids = musespark1x_routing_reference(stored, stored_bias, 4, 1.0, n_group=4, topk_group=2)
    assert all(len(set(row)) <= 2 for row in (ids // 4).tolist())  # each token picks within 2 of the 4 groups
    assert balance_counts(folder, "--reference") == {0: counts(ids.numpy(), 16)}


def _blob_logits(path):
    from safetensors.torch import load_file

    return load_file(str(path))["routing_logits"]


# -- refusals ----------------------------------------------------------------------------------
def _npy_bytes(a) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=True)
    return buf.getvalue()


def _tampered_generate() -> dict:
    """A /generate response whose prompt_tokens no longer match its routed_experts (5 tokens)."""
    doc = sglang_generate(routed_experts(5, 3, 2, 8).astype(np.int32), 4)
    doc["meta_info"]["prompt_tokens"] = 9
    return doc


def _retype(path, **arrays):
    """An ``np.savez`` archive with some members replaced (a damaged or hand-edited dump)."""
    with np.load(path) as d:
        members = {k: d[k] for k in d.files}
    np.savez(path, **{**members, **arrays})


REFUSALS = {
    # vLLM: what np.save would write for other arrays, and damaged copies
    "float.npy": (lambda p: np.save(p, np.zeros((2, 2, 2), np.float32)), ["expert ids of dtype float32"]),
    "objects.npy": (lambda p: p.write_bytes(_npy_bytes(np.array([{"x": 1}], dtype=object))),
                    ["a .npy array of Python objects"]),
    "cut.npy": (lambda p: p.write_bytes(_npy_bytes(routed_experts(50, 2, 2, 8))[:-40]), ["the .npy header declares"]),
    "flat.npy": (lambda p: np.save(p, np.zeros((4, 2), np.uint8)), ["expected [num_tokens, num_layers, topk]"]),
    "twice.npy": (lambda p: np.save(p, np.array([[[1, 1]], [[2, 3]]], np.uint8)),
                  ["layer 0, token 0: the ids [1, 1] hold one expert twice"]),
    "off.json": (lambda p: write_json(p, vllm_completion([None])), ["no response carries routed_experts",
                                                                     "--enable-return-routed-experts"]),
    "b64.json": (lambda p: write_json(p, {**vllm_completion([None]), "choices": [
        {"index": 0, "routed_experts": "%%%"}]}), ["routed_experts is not base64"]),
    "negative.npy": (lambda p: np.save(p, np.array([[[1, 2]], [[-3, 4]]], np.int8)),
                     ["layer 0, token 1: the ids [-3, 4] hold a negative id"]),
    "wrapped.npy": (lambda p: np.save(p, np.array([[[1, 2]], [[2**63 + 1, 4]]], np.uint64)),
                    ["expert id 9223372036854775809 is out of range"]),
    "datetime.npy": (lambda p: np.save(p, np.zeros((2, 2, 2), "datetime64[s]")), ["expert ids of dtype datetime64"]),
    "huge.npy": (lambda p: p.write_bytes(_npy_bytes(routed_experts(5, 3, 2, 8)).replace(
        b"(5, 3, 2)", b"(99999999999999999999999, 3, 2)")), ["the .npy header declares"]),
    # SGLang: a response whose ids do not split into its tokens x layers x topk
    "sg.json": (lambda p: write_json(p, _tampered_generate()), ["do not split into 10 tokens"], ["--topk", "2"]),
    # Megatron RouterReplay
    "dict.pt": (lambda p: torch.save({"weights": torch.zeros(2)}, p),
                ["not an SGLang expert-distribution dump", "nor a Megatron RouterReplay recording"]),
    "float.pt": (lambda p: torch.save(torch.zeros(3, 2), p), ["expert ids of dtype torch.float32"]),
    "none.pt": (lambda p: torch.save([torch.zeros(3, 2, dtype=torch.long), None], p), ["layer 1 recorded nothing"]),
    # Megatron expert loads
    "v2.npz": (lambda p: np.savez(p, dump_version=np.asarray("mcore_ep_load_dump_v2"), loads=np.zeros((1, 1, 4))),
               ["dump_version 'mcore_ep_load_dump_v2'; routetool reads mcore_ep_load_dump_v1"]),
    "pickled.npz": (lambda p: np.savez(p, dump_version=np.asarray("mcore_ep_load_dump_v1"),
                                       loads=np.array([None], dtype=object)), ["of Python objects"]),
    "floatlayers.npz": (lambda p: write_mcore_ep_load(p, np.ones((2, 1, 4)), [1, 3], [1, 1]) and _retype(
        p, layer_numbers=np.asarray([1.5, 3.0])), ["layer_numbers of dtype float64, expected integers"]),
    "rankarray.npz": (lambda p: write_mcore_ep_load(p, np.ones((2, 1, 4)), [1, 3], [1, 1]) and _retype(
        p, global_rank=np.arange(3)), ["global_rank of shape [3], expected one integer"]),
    # FlashInfer-Trace
    "moe_renorm_topk2_e8_x.safetensors":
        (lambda p: write_flashinfer_workload(p.parent, "moe_renorm_topk2_e8", torch.zeros(0, 8), None).rename(p),
         ["workload: routing_logits holds no rows"]),
    "moe_fp8_block_scale_ds_routing_topk8_ng8_kg1_e32_h7168_i2048_x.safetensors":
        (lambda p: write_flashinfer_workload(p.parent, "moe_fp8_block_scale_ds_routing_topk8_ng8_kg1_e32_h7168_i2048",
                                             torch.randn(2, 32), torch.zeros(32)).rename(p),
         ["the definition's router is impossible: topk=8 must be at most the 4 experts of topk_group=1 groups"]),
    "moe_fp8_block_scale_topk8_e32_x.safetensors":
        (lambda p: write_flashinfer_workload(p.parent, "moe_fp8_block_scale_topk8_e32", torch.randn(2, 32),
                                             torch.zeros(32)).rename(p), ["names no FlashInfer-Trace MoE routing"]),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_damaged_or_unknown_variants_refused_in_one_line(tmp_path, name):
    make, words, *options = REFUSALS[name]
    path = tmp_path / name
    make(path)
    options = options[0] if options else []
    for command in (["import", path, "-o", tmp_path / "x.safetensors"], ["balance", path, "--no-progress"]):
        one_line_error(run(*command, *options), str(path.name), *words)
    assert not (tmp_path / "x.safetensors").exists()


def test_vllm_npy_of_either_byte_order_is_read_alike(tmp_path):
    # np.save keeps an array's byte order: a big-endian uint16 array is the same ids
    a = routed_experts(6, 2, 2, 300)
    write_vllm_npy(tmp_path / "native.npy", a)
    write_vllm_npy(tmp_path / "big.npy", a.astype(">u2"))
    native = balance_counts(tmp_path / "native.npy", "--num-experts", 300)
    assert balance_counts(tmp_path / "big.npy", "--num-experts", 300) == native
    assert native == {x: counts(a[:, x], 300) for x in range(2)}


def test_npy_base64_is_what_np_load_reads():
    # the writer's encoding is vLLM's numpy2base64: np.load(io.BytesIO(base64.b64decode(s)))
    import base64
    import io

    a = routed_experts(3, 2, 2, 8)
    assert np.array_equal(np.load(io.BytesIO(base64.b64decode(npy_base64(a))), allow_pickle=False), a)


@pytest.mark.parametrize("kind", ["flashinfer", "npy", "megatron"])
def test_trace_commands_name_an_engine_output_and_the_import(tmp_path, kind):
    if kind == "flashinfer":
        path = write_flashinfer_workload(tmp_path, DEFINITION, torch.randn(2, 16), torch.zeros(16))
        words = "looks like a FlashInfer-Trace MoE workload (.safetensors), not a routetool trace"
    elif kind == "npy":
        path = write_vllm_npy(tmp_path / "req.npy", routed_experts(2, 2, 2, 8))
        words = "looks like vLLM routed experts, not a routetool trace"
    else:
        path = write_megatron_replay(tmp_path / "replay.pt", torch.zeros(2, 1, 2, dtype=torch.long) + 1, "tensor")
        words = "looks like a Megatron RouterReplay recording (.pt), not a routetool trace"
    for command in (["replay", path, "--device", "cpu", "--no-progress"], ["info", path]):
        one_line_error(run(*command), words, "routetool import")


def test_engine_outputs_read_num_experts_and_topk_only(tmp_path):
    # they record real requests, not warm-up rows: the filters of token-row dumps are refused, never ignored
    path = write_vllm_npy(tmp_path / "req.npy", routed_experts(3, 2, 2, 8))
    one_line_error(run("import", path, "-o", tmp_path / "x.safetensors", "--skip-rows", "1"),
                   "--skip-rows does not apply to a vllm dump (it reads --num-experts, --topk)")
    one_line_error(run("balance", path, "--drop-repeats", "0", "--no-progress"),
                   "--drop-repeats does not apply to a vllm dump")
