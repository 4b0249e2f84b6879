"""routetool.io.info: header facts without reading data, counts with --scan, sharded traces."""

from pathlib import Path

import pytest
import torch

from routetool.io.info import trace_info
from routetool.report.capture import info_json
from routetool.io.sharded import write_index
from routetool.io.trace import LayerArrays, RouterConfig, Trace, open_trace

ROOT = Path(__file__).resolve().parents[2]
SYNTH = ROOT / "traces" / "musespark1x-synth-bf16.safetensors"
HF = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"


def test_header_facts_of_the_bundled_traces():
    with open_trace(SYNTH) as t:
        info = trace_info(t)
    assert not info.scanned and info.padded_rows is None and info.nonfinite_rows is None
    assert [x.layer for x in info.layers] == [0, 1, 2, 3]
    assert info.router.num_experts == 256 and info.router.topk == 8
    assert info.total_tokens == 4580 and info.recorded_outputs == "none"
    assert info.metadata["generator"] == "routetool.synth"
    assert info.size_bytes == SYNTH.stat().st_size and not info.sharded
    layer = info.layers[0]
    assert layer.num_steps == 26 and layer.step_tokens[:2] == [384, 97] and sum(layer.step_tokens) == 1145
    assert layer.tensors["gating_output"].dtype == "bfloat16" and layer.tensors["gating_output"].shape == (1145, 256)
    assert layer.tensors["is_padding"].shape == (1145,) and layer.tensors["step_offsets"].shape == (27,)
    assert info.steps_same_in_all_layers and sum(info.step_shapes.values()) == 26

    with open_trace(HF) as t:
        info = trace_info(t)
    assert info.recorded_outputs == "all" and info.metadata["weights_semantics"] == "renormalized"
    assert [x.layer for x in info.layers] == [1, 2, 3]
    assert info.layers[0].tensors["topk_ids"].dtype == "int32"
    assert info.layers[0].tensors["gating_output"].dtype == "float32"
    assert info.step_shapes == {384: 1, 4: 12}
    assert info.layers[0].bias_abs_max > 0


def test_header_only_reads_no_rows(monkeypatch):
    def no_reads(*a, **k):
        raise AssertionError("info without --scan must not read tensor rows")

    monkeypatch.setattr(Trace, "read_rows", no_reads)
    with open_trace(SYNTH) as t:
        assert trace_info(t).total_tokens == 4580
        with pytest.raises(AssertionError):
            trace_info(t, scan=True)


def test_scan_counts_padded_and_nonfinite_rows(make_trace):
    E, K = 8, 2
    g = torch.randn(10, E)
    g[2, 3] = float("nan")
    g[7, 0] = float("inf")  # on a padded row
    g[8, 1] = float("-inf")
    pad = torch.zeros(10, dtype=torch.bool)
    pad[6:8] = True
    path = make_trace("t.safetensors", {
        0: LayerArrays(gating_output=g, is_padding=pad, step_offsets=torch.tensor([0, 6, 8, 10])),
        5: LayerArrays(gating_output=torch.randn(4, E).bfloat16()),
    }, router=RouterConfig(num_experts=E, topk=K))
    done = []
    with open_trace(path) as t:
        info = trace_info(t, scan=True, progress=done.append)
    assert sum(done) == 14
    a, b = info.layers
    assert (a.padded_rows, a.nonfinite_rows, a.nonfinite_padded_rows) == (2, 3, 1)
    assert a.padded_fraction == pytest.approx(0.2)
    assert (b.padded_rows, b.nonfinite_rows) == (0, 0) and not b.has_padding and "step_offsets" not in b.tensors
    assert info.padded_rows == 2 and info.nonfinite_rows == 3 and info.padded_fraction == pytest.approx(2 / 14)
    assert not info.steps_same_in_all_layers and info.step_shapes == {2: 2, 4: 1, 6: 1}
    doc = info_json(info)
    assert doc["schema"] == "routetool.info/1" and doc["scanned"] is True
    assert doc["layers"][0]["tensors"]["gating_output"] == {"shape": [10, E], "dtype": "float32"}
    assert doc["layers"][1]["tensors"]["gating_output"]["dtype"] == "bfloat16"
    assert doc["layers"][0]["step_tokens"] == [6, 2, 2] and doc["nonfinite_rows"] == 3


def test_sharded_trace_info(tmp_path, make_sharded):
    shards = [{2: LayerArrays(gating_output=torch.randn(sum(sizes), 6),
                              step_offsets=torch.tensor([0, *sizes]).cumsum(0))} for sizes in ([3, 4], [5])]
    index = make_sharded("run.json", shards, RouterConfig(num_experts=6, topk=2), complete=False,
                         stopped_by="error: KeyboardInterrupt: ")
    with open_trace(index) as t:
        info = trace_info(t, scan=True)
    assert info.sharded and info.index == {"complete": False, "stopped_by": "error: KeyboardInterrupt: ",
                                           "num_shards": 2, "last_complete_step": None}
    assert [f.role for f in info.files] == ["index", "shard", "shard"]
    assert info.size_bytes == sum(p.stat().st_size for p in tmp_path.iterdir())
    layer = info.layers[0]
    assert layer.step_tokens == [3, 4, 5] and layer.tensors["gating_output"].shape == (12, 6)
    assert layer.tensors["step_offsets"].shape == (4,)


def test_check_trace_file_refuses_non_regular_files(tmp_path):
    import os

    from routetool.errors import RouteToolError
    from routetool.io.info import check_trace_file

    fifo = tmp_path / "t.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(RouteToolError, match="t.safetensors: is not a regular file"):
        check_trace_file(fifo)
    check_trace_file(SYNTH)  # a regular file passes
    check_trace_file(tmp_path / "missing.safetensors")  # left to open_trace, which names it
    check_trace_file(tmp_path)  # a directory too


def test_sharded_trace_with_a_shard_listed_twice_is_refused(tmp_path, make_trace):
    from routetool.errors import RouteToolError

    shard = make_trace("run-00000.safetensors", {0: LayerArrays(gating_output=torch.randn(5, 8))},
                       router=RouterConfig(num_experts=8, topk=2))
    index = tmp_path / "run.json"
    write_index(index, [{"path": shard.name}, {"path": shard.name}], complete=True, stopped_by="exit")
    with pytest.raises(RouteToolError, match="listed twice"):
        open_trace(index)
