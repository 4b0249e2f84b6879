"""`routetool replay --save-routing`: the kernel's routing kept by the router's capture hook and
written as ids-only traces that `routetool diff` and `routetool replay` read."""

import json

import pytest
import torch
from click.testing import CliRunner

from conftest import HAS_CUDA
from routetool.cli import main
from routetool.io.trace import LayerArrays, RouterConfig, open_trace
from routetool_kernels.reference import musespark1x_routing_reference

DEVICE = "cuda" if HAS_CUDA else "cpu"
ROUTER = RouterConfig(num_experts=8, topk=2, route_scale=2.5)


def _run(*args):
    return CliRunner().invoke(main, [*map(str, args)], catch_exceptions=False)


@pytest.fixture
def logits_trace(make_trace):
    """``logits_trace(path, seed=0, rank=None) -> Path``: layers 0 and 3 of 7 rows (two steps, two padded
    rows) of random logits and bias under :data:`ROUTER`, naming ``rank`` when given."""
    def make(path, seed=0, rank=None):
        gen = torch.Generator().manual_seed(seed)
        arrays = {}
        for layer in (0, 3):
            g = torch.randn(7, 8, generator=gen)
            pad = torch.tensor([False, False, True, False, False, False, True])
            arrays[layer] = LayerArrays(gating_output=g, bias=torch.randn(8, generator=gen) * 0.1, is_padding=pad,
                                        step_offsets=torch.tensor([0, 3, 7]))
        return make_trace(path, arrays, ROUTER, **({} if rank is None else {"rank": str(rank)}))
    return make


def test_the_router_hands_each_routed_chunk_to_its_capture_hook(tmp_path, logits_trace):
    from routetool.engine.router import Router
    from routetool.engine.stream import stream_layer

    seen = []
    with open_trace(logits_trace("t.safetensors")) as t:
        reference = Router.reference(ROUTER)
        router = Router(reference.spec, reference.fn, reference.name, per_row=True,
                        on_routed=lambda chunk, routed: seen.append((chunk.layer, chunk.rows, routed.ids.clone())))
        for layer in t.layers:
            for chunk in stream_layer(t, layer, torch.device("cpu"), whole_steps=True):
                routed = router.route(chunk, t.bias(layer))
                assert torch.equal(seen[-1][2], routed.ids)
    assert [(layer, rows) for layer, rows, _ in seen] == [(0, 7), (3, 7)]


def test_saved_routing_is_the_kernels_and_diff_reads_it(tmp_path, logits_trace):
    src = logits_trace("trace.safetensors")
    out = tmp_path / "routing.safetensors"
    res = _run("replay", src, "--device", DEVICE, "--no-progress", "--no-latency", "--save-routing", out)
    assert res.exit_code == 0, res.output
    assert f"wrote {out}" in res.output.replace("\n", "")
    with open_trace(src) as t, open_trace(out) as r:
        assert list(r.layers) == list(t.layers) == [0, 3] and r.meta.router == ROUTER
        assert r.meta.extra["routed_by"] == "tiled" and r.meta.extra["source"] == str(src)
        for layer in t.layers:
            whole, saved = t.read_rows(layer, 0, 7), r.read_rows(layer, 0, 7)
            assert r.info(layer).step_offsets == (0, 3, 7) and not r.info(layer).has_logits
            assert torch.equal(saved.is_padding, whole.is_padding)
            w, ids = musespark1x_routing_reference(whole.gating_output, t.bias(layer), **ROUTER.kernel_kwargs(),
                                                   is_padding=whole.is_padding)
            # the kernel's own routing: ids as the reference's (no near-ties here), weights within ulps
            assert torch.equal(saved.recorded_ids.long().sort(-1).values, ids.long().sort(-1).values)
            assert (saved.recorded_ids[whole.is_padding] == -1).all()
            torch.testing.assert_close(saved.recorded_weights.sort(-1).values, w.sort(-1).values)
    same = _run("diff", out, out, "--json", tmp_path / "d.json")
    assert same.exit_code == 0 and same.output.startswith("IDENTICAL"), same.output
    against = _run("diff", src, out, "--json", tmp_path / "d2.json")
    assert against.exit_code in (0, 1), against.output  # weights may differ by ulps, never the experts
    doc = json.loads((tmp_path / "d2.json").read_text())
    assert doc["overall"]["set_agreement"] == 1.0


def test_a_run_folder_saves_a_run_folder_and_never_into_an_existing_one(tmp_path, logits_trace):
    run = tmp_path / "run"
    for r in (0, 1):
        (run / f"rank-{r}").mkdir(parents=True)
        logits_trace(run / f"rank-{r}" / "trace.safetensors", seed=r, rank=r)
    (tmp_path / "taken").mkdir()
    refused = _run("replay", run, "--device", DEVICE, "--no-progress", "--save-routing", tmp_path / "taken")
    assert refused.exit_code == 2 and "already exists" in refused.output and "Traceback" not in refused.output
    assert len(refused.output.strip().splitlines()) == 1, refused.output
    out = tmp_path / "routing"
    res = _run("replay", run, "--device", DEVICE, "--no-progress", "--no-latency", "--save-routing", out)
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["rank-0", "rank-1"]
    with open_trace(out / "rank-1" / "routing.safetensors") as r:
        assert r.meta.extra["rank"] == "1" and list(r.layers) == [0, 3]
    again = _run("replay", out, "--device", DEVICE, "--no-progress", "--json", "-")  # a run folder itself
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["layers"][0]["ids_only"] is True


def test_nothing_to_save_and_outputs_that_would_destroy_data_are_one_line_exit_2(tmp_path, make_trace,
                                                                                 logits_trace):
    ids_only = make_trace("ids.safetensors", {0: LayerArrays(topk_ids=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))},
                          ROUTER)
    res = _run("replay", ids_only, "--device", DEVICE, "--no-progress", "--save-routing", tmp_path / "r.safetensors")
    assert res.exit_code == 2 and "no kernel routing to save" in res.output, res.output
    assert res.output.startswith(f"routetool: error: {ids_only}: holds no logits") and "PASS" not in res.output
    assert not (tmp_path / "r.safetensors").exists()
    src = logits_trace("trace.safetensors")
    before = src.read_bytes()
    for args, words in (((src,), "input"), (("-",), "stdout")):
        res = _run("replay", src, "--device", DEVICE, "--no-progress", "--save-routing", *args)
        assert res.exit_code == 2 and words in res.output and "Traceback" not in res.output, res.output
    (tmp_path / "old.safetensors").write_text("mine")
    res = _run("replay", src, "--device", DEVICE, "--no-progress", "--save-routing", tmp_path / "old.safetensors")
    assert res.exit_code == 2 and (tmp_path / "old.safetensors").read_text() == "mine"
    assert src.read_bytes() == before
