"""Sharded traces (routetool.io.sharded) and the open_trace entry point."""

import json

import pytest
import torch

from routetool.errors import RouteToolError
from routetool.io.sharded import ShardedTrace, looks_like_index, read_index, shard_path, write_index
from routetool.io.trace import LayerArrays, RouterConfig, Trace, open_trace
from conftest import DEVICE

E, K = 12, 3
ROUTER = RouterConfig(num_experts=E, topk=K, route_scale=2.0)


def _layer(gen, sizes, *, padding=True, outputs=False, bias=None, dtype=torch.float32):
    T = sum(sizes)
    pad = torch.zeros(T, dtype=torch.bool)
    if padding:
        pad[sizes[0] - 1] = True
    return LayerArrays(
        gating_output=torch.randn((T, E), generator=gen).to(dtype),
        bias=bias if bias is not None else torch.linspace(-0.1, 0.1, E),
        is_padding=pad if padding else None,
        step_offsets=torch.tensor([0, *sizes]).cumsum(0),
        topk_ids=torch.randint(0, E, (T, K), generator=gen, dtype=torch.int32) if outputs else None,
        topk_weights=torch.rand((T, K), generator=gen) if outputs else None,
    )


def test_steps_concatenate_in_shard_order(make_sharded):
    gen = torch.Generator().manual_seed(0)
    a = {0: _layer(gen, [5, 2]), 1: _layer(gen, [5, 2], padding=False)}
    b = {0: _layer(gen, [3]), 1: _layer(gen, [3], padding=True)}  # layer 1 padded only in shard 1
    c = {0: _layer(gen, [4, 1, 6])}  # layer 1 absent from the last shard
    index = make_sharded("run.json", [a, b, c], ROUTER)
    with open_trace(index) as t:
        assert isinstance(t, ShardedTrace) and t.display_path == index
        assert t.layers == (0, 1)
        assert t.info(0).step_offsets == (0, 5, 7, 10, 14, 15, 21)
        assert t.info(1).step_offsets == (0, 5, 7, 10)
        assert t.info(1).has_padding  # padding of any shard makes the layer padded
        assert t.total_tokens == 21 + 10
        steps = list(t.steps(0))
        assert [s.index for s in steps] == list(range(6))
        assert [s.start for s in steps] == [0, 5, 7, 10, 14, 15]
        full = torch.cat([a[0].gating_output, b[0].gating_output, c[0].gating_output])
        assert torch.equal(torch.cat([s.gating_output for s in steps]), full)
        # rows across two shard boundaries read as one
        rows = t.read_rows(0, 6, 16)
        assert rows.start == 6 and torch.equal(rows.gating_output, full[6:16])
        assert torch.equal(rows.is_padding, torch.cat([a[0].is_padding, b[0].is_padding, c[0].is_padding])[6:16])
        empty = t.read_rows(0, 7, 7)
        assert empty.gating_output.shape == (0, E) and empty.is_padding.shape == (0,)
        # a shard without is_padding reads as unpadded where other shards pad the layer
        pads = [s.is_padding for s in t.steps(1)]
        assert all(p is not None for p in pads) and not pads[0].any() and pads[2].sum() == 1
        assert torch.equal(t.bias(0), a[0].bias)
        assert t.meta.extra["shards"] == "3"


def test_open_trace_picks_the_reader(tmp_path, make_sharded, make_trace):
    gen = torch.Generator().manual_seed(1)
    single = make_trace("one.safetensors", {0: _layer(gen, [4])}, router=ROUTER)
    with open_trace(single) as t:
        assert isinstance(t, Trace) and t.total_tokens == 4
    index = make_sharded("run.json", [{0: _layer(gen, [4])}], ROUTER)
    renamed = tmp_path / "index-without-suffix"
    renamed.write_text(index.read_text())
    assert looks_like_index(renamed) and not looks_like_index(single)
    with open_trace(renamed) as t:
        assert isinstance(t, ShardedTrace) and t.total_tokens == 4


def test_replay_reads_a_sharded_trace_like_one_file(make_sharded, make_trace):
    from routetool.engine.execution import load_kernel, select_execution
    from routetool.analysis.replay import replay_trace

    gen = torch.Generator().manual_seed(2)
    parts = [{3: _layer(gen, [6, 2])}, {3: _layer(gen, [5])}]
    index = make_sharded("run.json", parts, ROUTER)
    whole = LayerArrays(
        gating_output=torch.cat([p[3].gating_output for p in parts]), bias=parts[0][3].bias,
        is_padding=torch.cat([p[3].is_padding for p in parts]), step_offsets=torch.tensor([0, 6, 8, 13]),
    )
    single = make_trace("whole.safetensors", {3: whole}, router=ROUTER)
    execution = select_execution(DEVICE.type)
    name, fn = load_kernel("tiled")
    with open_trace(index) as a, open_trace(single) as b:
        ra = replay_trace(a, name, fn, execution, measure_latency=False)
        rb = replay_trace(b, name, fn, execution, measure_latency=False)
    assert ra.ok and rb.ok
    assert ra.layers[0].expert_counts == rb.layers[0].expert_counts
    assert ra.layers[0].num_steps == 3 and ra.layers[0].padded_rows == rb.layers[0].padded_rows == 2


@pytest.mark.parametrize("break_it, message", [
    # each: how the shards disagree -> the one-line error names the shard and what differs
    (lambda gen: ([{0: _layer(gen, [3])}, {0: _layer(gen, [3])}],
                  [RouterConfig(num_experts=E, topk=K, route_scale=2.0),
                   RouterConfig(num_experts=E, topk=K, route_scale=2.5)]),
     "run-00001.safetensors: __metadata__: shard 1 has router"),
    (lambda gen: ([{0: _layer(gen, [3])}, {0: _layer(gen, [3], bias=torch.zeros(E))}], None),
     "run-00001.safetensors: layers.0.bias: shard 1 has another bias"),
    (lambda gen: ([{0: _layer(gen, [3])}, {0: _layer(gen, [3], dtype=torch.bfloat16)}], None),
     "run-00001.safetensors: layers.0: shard 1 disagrees with shard 0 on gating_output dtype"),
    (lambda gen: ([{0: _layer(gen, [3], outputs=True)}, {0: _layer(gen, [3])}], None),
     "shard 1 disagrees with shard 0 on recorded topk_ids"),
])
def test_shards_must_agree(break_it, message, make_sharded):
    shards, routers = break_it(torch.Generator().manual_seed(3))
    index = make_sharded("run.json", shards, routers or ROUTER)
    with pytest.raises(RouteToolError, match=message.replace("(", r"\(")):
        open_trace(index)


def test_weights_semantics_must_agree(make_sharded):
    gen = torch.Generator().manual_seed(4)
    shards = [{0: _layer(gen, [2], outputs=True)}, {0: _layer(gen, [2], outputs=True)}]
    index = make_sharded("run.json", shards, ROUTER,
                         shard_meta=[{"weights_semantics": "renormalized"}, {"weights_semantics": "unnormalized"}])
    with pytest.raises(RouteToolError, match="weights_semantics"):
        open_trace(index)


@pytest.mark.parametrize("doc, message", [
    ("not json", r"run.json: index: line 1: not JSON \(Expecting value\)"),
    ('{"format": "something-else", "version": "1", "shards": []}', "not a routetool trace index"),
    ('{"format": "routetool-trace-index", "version": "9", "shards": []}', "version '9' is not supported"),
    ('{"format": "routetool-trace-index", "version": "1", "shards": []}', "lists no shards"),
    ('{"format": "routetool-trace-index", "version": "1", "shards": [{"size_bytes": 3}]}', "shard entry 0 has no path"),
    ('{"format": "routetool-trace-index", "version": "1", "shards": [{"path": "gone.safetensors"}]}',
     "gone.safetensors: shard 0 listed in the index run.json does not exist"),
    # a repeated key was accepted, the last one winning (here the shards list that exists)
    ('{"format": "routetool-trace-index", "version": "1", "shards": [{"path": "a.safetensors"}], "shards": []}',
     "index: the key 'shards' appears twice in one object \\(JSON readers differ on which value counts\\) "
     "\\(write each key once in each object\\)"),
    ('{"format": "routetool-trace-index", "version": "1", "shards": [{"path": "a", "path": "b"}]}',
     "the key 'path' appears twice"),
    # a number said "version 1 is not supported (this routetool reads '1')"
    ('{"format": "routetool-trace-index", "version": 1, "shards": []}',
     'index.version: "version" is 1, not a string: it must be the string "1" \\(write "version": "1", with the '
     'quotes\\)'),
    ('{"format": "routetool-trace-index", "shards": []}', '"version" is absent: it must be the string "1"'),
])
def test_bad_index(tmp_path, doc, message):
    index = tmp_path / "run.json"
    index.write_text(doc)
    with pytest.raises(RouteToolError, match=message):
        open_trace(index)


def test_replaced_or_truncated_shard_is_caught(make_sharded):
    gen = torch.Generator().manual_seed(5)
    index = make_sharded("run.json", [{0: _layer(gen, [4])}, {0: _layer(gen, [4])}], ROUTER)
    shard = shard_path(index, 1)
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(RouteToolError, match="shard 1 has .* bytes but the index run.json says"):
        open_trace(index)
    doc = read_index(index)
    doc["shards"][1].pop("size_bytes")  # without the size, the reader's own checks catch it
    index.write_text(json.dumps(doc))
    with pytest.raises(RouteToolError, match="run-00001.safetensors: not a readable safetensors file"):
        open_trace(index)


def test_missing_index_and_shard_path_naming(tmp_path):
    with pytest.raises(RouteToolError, match="nope.json: no such file"):
        open_trace(tmp_path / "nope.json")
    assert shard_path(tmp_path / "a.b.json", 12).name == "a.b-00012.safetensors"


@pytest.fixture
def one_shard(tmp_path, make_trace):
    """Shard 0 of ``run.json`` (2 steps of layer 0), with no index yet."""
    gen = torch.Generator().manual_seed(6)
    return make_trace(shard_path(tmp_path / "run.json", 0), {0: _layer(gen, [4, 2])}, router=ROUTER)


@pytest.mark.parametrize("entries, message", [
    # the same shard twice used to be read twice: every count doubled
    (lambda s: [{"path": s.name}, {"path": s.name}],
     r"run.json: index.shards\[1\]: shard 1 \(run-00000.safetensors\) is listed twice \(also as shard 0\)"),
    (lambda s: [{"path": s.name}, {"path": f"./{s.name}"}], r"is listed twice \(also as shard 0\)"),
    (lambda s: [{"path": s.name}, {"path": str(s)}],
     "run-00000.safetensors: shard 1 listed in the index run.json is the same file as shard 0"),
    (lambda s: [{"path": s.name, "size_bytes": "big"}],
     r"run.json: index.shards\[0\]: shard 0 \(run-00000.safetensors\): size_bytes=\"big\" is not a byte count"),
    (lambda s: [{"path": s.name, "size_bytes": -3}], "size_bytes=-3 is not a byte count"),
    (lambda s: [{"path": s.name, "size_bytes": 1.5}], "size_bytes=1.5 is not a byte count"),
    (lambda s: [{"path": s.name, "size_bytes": True}], "size_bytes=true is not a byte count"),
    (lambda s: [{"path": "."}], r"shard 0 listed in the index run.json is a directory, not a shard file"),
])
def test_bad_shard_entries_name_the_index_and_the_shard(tmp_path, one_shard, entries, message):
    index = tmp_path / "run.json"
    write_index(index, entries(one_shard), complete=True, stopped_by="exit")
    with pytest.raises(RouteToolError, match=message):
        open_trace(index)


@pytest.mark.parametrize("tensors, meta, message", [
    # layers.00 was read as layer 0 of the shard, its tensors replacing those of layers.0
    ({"layers.0.gating_output": torch.zeros(2, E), "layers.00.gating_output": torch.ones(2, E)}, {},
     r"run-00001.safetensors: layers.00.gating_output: layer index '00' has a leading zero .* two names for layer 0"),
    ({"layers.\uff10.gating_output": torch.zeros(2, E)}, {},
     "run-00001.safetensors: layers.\uff10.gating_output: layer index '\uff10' is not a plain decimal index"),
    # float("2_5") is 25.0, the route_scale of shard 0: the shards seemed to agree
    ({"layers.0.gating_output": torch.zeros(2, E)}, {"route_scale": "2_5"},
     r"run-00001.safetensors: __metadata__: metadata route_scale='2_5' is not a plain decimal number"),
])
def test_a_shard_with_loose_layer_names_or_numbers_is_refused(make_sharded, raw_trace, tensors, meta, message):
    from dataclasses import replace

    gen = torch.Generator().manual_seed(8)
    router = replace(ROUTER, route_scale=25.0)
    shard0 = {0: _layer(gen, [2], padding=False, bias=torch.zeros(E))}
    index = make_sharded("run.json", [shard0, shard0], router)  # shard 1 is replaced below
    raw_trace(shard_path(index, 1), tensors, router, **meta)
    doc = read_index(index)
    doc["shards"][1].pop("size_bytes")
    index.write_text(json.dumps(doc))
    with pytest.raises(RouteToolError, match=message) as info:
        open_trace(index)
    assert "\n" not in str(info.value)


@pytest.fixture
def index_with(tmp_path, one_shard):
    """``index_with(key, value)``: a one-shard index written by the recorder, then ``key`` set to
    ``value``: (path, document)."""
    def make(key, value):
        index = tmp_path / "run.json"
        write_index(index, [{"path": one_shard.name}], complete=True, stopped_by="exit")
        doc = json.loads(index.read_text())
        doc[key] = value
        index.write_text(json.dumps(doc))
        return index, doc
    return make


@pytest.mark.parametrize("value", ["yes", "false", 1, None])
def test_complete_must_be_a_json_boolean(value, index_with):
    # "complete": "yes" (or "false", a truthy string) was shown by info as a complete recording
    index, doc = index_with("complete", value)
    with pytest.raises(RouteToolError) as info:
        open_trace(index)
    assert str(info.value) == (f"{index}: index.complete: \"complete\" is {json.dumps(value)}, not a JSON boolean "
                               "(write \"complete\": true (the recording ended normally) or false, without quotes)")
    doc["complete"] = False
    index.write_text(json.dumps(doc))
    with open_trace(index) as t:
        assert t.index["complete"] is False


@pytest.mark.parametrize("value", [1, True, ["exit"], {"why": "exit"}])
def test_stopped_by_must_be_a_string_or_null(value, index_with):
    # any JSON value was shown by info and capture as how the recording ended
    index, doc = index_with("stopped_by", value)
    with pytest.raises(RouteToolError, match=r"run.json: index.stopped_by: \"stopped_by\" is .*, not a string or null"):
        open_trace(index)
    doc["stopped_by"] = None
    index.write_text(json.dumps(doc))
    with open_trace(index) as t:
        assert t.index["stopped_by"] is None


def test_shards_must_be_a_list(tmp_path):
    index = tmp_path / "run.json"
    index.write_text(json.dumps({"format": "routetool-trace-index", "version": "1", "shards": "x"}))
    with pytest.raises(RouteToolError, match=r"run.json: index.shards: \"shards\" must be a list of shard entries, "
                                             r"not str \"x\""):
        open_trace(index)
    index.write_text(json.dumps({"format": "routetool-trace-index", "version": "1"}))
    with pytest.raises(RouteToolError, match="lists no shards"):
        open_trace(index)


def test_non_regular_index_and_shards_are_refused(tmp_path):
    import os

    fifo = tmp_path / "run-00000.safetensors"
    os.mkfifo(fifo)
    index = tmp_path / "run.json"
    write_index(index, [{"path": fifo.name}], complete=True, stopped_by="exit")
    with pytest.raises(RouteToolError, match="run-00000.safetensors: shard 0 listed in the index run.json is not a "
                                             "regular file"):
        open_trace(index)
    fifo_index = tmp_path / "fifo.json"
    os.mkfifo(fifo_index)
    with pytest.raises(RouteToolError, match="fifo.json: is not a regular file"):
        read_index(fifo_index)


@pytest.mark.parametrize("args", [
    ["replay", "{index}", "--json", "{shard}", "--force"],
    ["validate", "{index}", "--suite", "none", "--junit", "{shard}", "--force"],
    ["balance", "{index}", "--json", "{shard}", "--force"],
    ["balance", "{index}", "--eplb-out", "{shard}", "--force"],
    ["info", "{index}", "--json", "{shard}", "--force"],
])
def test_outputs_never_replace_a_shard_of_the_input(args, make_sharded):
    from click.testing import CliRunner

    from routetool.cli import main

    gen = torch.Generator().manual_seed(3)
    index = make_sharded("run.json", [{0: _layer(gen, [4])}, {0: _layer(gen, [2, 3])}], ROUTER)
    shard = shard_path(index, 1)
    before = shard.read_bytes()
    res = CliRunner().invoke(main, [a.format(index=index, shard=shard) for a in args])
    assert res.exit_code == 2, res.output
    assert "is this run's input" in res.output and shard.name in res.output
    assert shard.read_bytes() == before
