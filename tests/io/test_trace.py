"""Trace v1 reader and writer: round trip, lazy steps, and every kind of broken file."""

import os

import pytest
import torch

from routetool.errors import RouteToolError
from routetool.io.trace import FORMAT_NAME, LayerArrays, RouterConfig, Trace, TraceMeta, write_trace

E, K = 8, 2


def _layer(T=6, dtype=torch.float32, **kw):
    g = torch.Generator().manual_seed(T)
    arrays = dict(
        gating_output=torch.randn((T, E), generator=g).to(dtype),
        bias=torch.randn(E, generator=g) * 0.1,
        is_padding=torch.tensor([False] * (T - 1) + [True]),
        step_offsets=torch.tensor([0, T // 2, T]),
    )
    arrays.update(kw)
    return LayerArrays(**{k: v for k, v in arrays.items() if v is not None})


def test_round_trip_and_steps(make_trace):
    path = make_trace("t.safetensors", {0: _layer(), 3: _layer(T=4, dtype=torch.bfloat16)})
    with Trace(path) as t:
        assert t.layers == (0, 3)
        assert t.meta.router == RouterConfig(num_experts=E, topk=K, route_scale=1.0)
        assert t.info(3).gating_dtype == torch.bfloat16 and t.info(3).num_steps == 2
        steps = list(t.steps(0))
        assert [s.start for s in steps] == [0, 3] and [s.num_tokens for s in steps] == [3, 3]
        assert steps[1].is_padding.tolist() == [False, False, True]
        assert torch.equal(torch.cat([s.gating_output for s in steps]), _layer().gating_output)
        assert t.total_tokens == 10
    assert oct(os.stat(path).st_mode & 0o777) != "0o600"


def test_optional_tensors_and_defaults(make_trace):
    path = make_trace("t.safetensors", {0: _layer(bias=None, is_padding=None, step_offsets=None)})
    with Trace(path) as t:
        assert t.bias(0).tolist() == [0.0] * E
        assert t.info(0).step_offsets == (0, 6) and not t.info(0).has_padding


def test_writer_refuses_to_overwrite(tmp_path, make_trace):
    path = make_trace("t.safetensors", {0: _layer()})
    before = path.read_bytes()
    meta = TraceMeta(model="x", router=RouterConfig(num_experts=E, topk=K), provenance="")
    with pytest.raises(RouteToolError, match="already exists.*--force"):
        write_trace(path, meta, {0: _layer(T=9)})
    assert path.read_bytes() == before
    with pytest.raises(RouteToolError, match="folder does not exist"):
        write_trace(tmp_path / "nope" / "t.safetensors", meta, {0: _layer()})
    (tmp_path / "notes.txt").write_text("x")
    for out in (tmp_path / "notes.txt" / "t.safetensors", tmp_path / "notes.txt" / "sub" / "t.safetensors"):
        with pytest.raises(RouteToolError, match=r"notes\.txt: is a file, not a folder \(choose another output path"):
            write_trace(out, meta, {0: _layer()})
    assert (tmp_path / "notes.txt").read_text() == "x"


def test_writer_validates_before_replacing(tmp_path, make_trace):
    path = make_trace("t.safetensors", {0: _layer()})
    before = path.read_bytes()
    with pytest.raises(RouteToolError, match="layers.0.gating_output: has 5 experts"):
        make_trace(path, {0: _layer(gating_output=torch.zeros((6, 5)))})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"], "temporary file left behind"


GOOD = {"layers.0.gating_output": torch.zeros((4, E)), "layers.0.bias": torch.zeros(E)}

BROKEN = [
    # (tensors, metadata overrides, expected message fragment)
    ({**GOOD, "layers.0.gating_output": torch.zeros((4, 7))}, {}, "layers.0.gating_output: has 7 experts"),
    ({**GOOD, "layers.0.gating_output": torch.zeros((4, E), dtype=torch.int32)}, {}, "has dtype int32"),
    ({**GOOD, "layers.0.gating_output": torch.zeros(4 * E)}, {}, "layers.0.gating_output: has shape [32]"),
    ({"layers.0.bias": torch.zeros(E)}, {}, "layers.0.gating_output: missing (the layer has neither gating_output "
                                            "nor topk_ids) (add layers.0.gating_output [T, num_experts=8], or "
                                            "layers.0.topk_ids [T, topk=2] for an ids-only layer)"),
    ({**GOOD, "layers.0.bias": torch.zeros(E + 1)}, {}, "layers.0.bias: is float32 [9]"),
    ({**GOOD, "layers.0.bias": torch.full((E,), float("nan"))}, {}, "layers.0.bias: has 8 non-finite"),
    ({**GOOD, "layers.0.is_padding": torch.zeros(4)}, {}, "layers.0.is_padding: is float32"),
    ({**GOOD, "layers.0.step_offsets": torch.tensor([0, 3])}, {}, "layers.0.step_offsets: runs from 0 to 3"),
    # each dtype message lists exactly what docs/trace-format.md accepts: int32 offsets are read, and
    # "expected int64" hid that
    ({**GOOD, "layers.0.step_offsets": torch.tensor([0, 4], dtype=torch.int16)}, {},
     "layers.0.step_offsets: is int16 [2]; expected int64 or int32 [num_steps + 1]"),
    ({**GOOD, "layers.0.step_offsets": torch.tensor([0.0, 4.0])}, {},
     "layers.0.step_offsets: is float32 [2]; expected int64 or int32 [num_steps + 1]"),
    ({**GOOD, "layers.0.bias": torch.zeros(E, dtype=torch.float64)}, {},
     "layers.0.bias: is float64 [8]; expected float32, bfloat16 or float16 [8]"),
    ({**GOOD, "layers.0.is_padding": torch.zeros(4, dtype=torch.uint8)}, {},
     "layers.0.is_padding: is uint8 [4]; expected bool [4]"),
    ({**GOOD, "layers.0.gating_output": torch.zeros((4, E), dtype=torch.float64)}, {},
     "layers.0.gating_output: has dtype float64; expected float32, bfloat16 or float16"),
    ({**GOOD, "layers.0.topk_ids": torch.zeros((4, K), dtype=torch.int16)}, {},
     "layers.0.topk_ids: has dtype int16; expected int32 or int64"),
    ({**GOOD, "layers.0.topk_ids": torch.zeros((4, K), dtype=torch.int32),
      "layers.0.topk_weights": torch.zeros((4, K), dtype=torch.float64)}, {},
     "layers.0.topk_weights: has dtype float64; expected float32, bfloat16 or float16"),
    # a dtype routetool has no name for (uint16) named the docs, not the dtypes the tensor accepts
    ({**GOOD, "layers.0.step_offsets": torch.tensor([0, 4], dtype=torch.uint16)}, {},
     "layers.0.step_offsets: has dtype U16; expected int64 or int32 (store it in one of those dtypes"),
    ({**GOOD, "layers.0.step_offsets": torch.tensor([0, 3, 3, 4])}, {}, "not strictly increasing"),
    # a layer of no rows with step_offsets [0] was "is int64 [1]; expected int64 [num_steps + 1]", and [1] is that
    ({"layers.0.gating_output": torch.zeros((0, E)), "layers.0.step_offsets": torch.tensor([0])}, {},
     "layers.0.step_offsets: is int64 [1], but the layer holds no token rows (layers.0.gating_output is [0, 8]): "
     "step_offsets marks the steps of a layer with tokens (leave step_offsets out for a layer without tokens, or "
     "re-capture the trace with tokens in every layer)"),
    ({"layers.0.topk_ids": torch.zeros((0, K), dtype=torch.int32), "layers.0.step_offsets": torch.tensor([0])}, {},
     f"the layer holds no token rows (layers.0.topk_ids is [0, {K}])"),
    ({**GOOD, "layers.0.topk_ids": torch.zeros((4, 3), dtype=torch.int32)}, {}, "layers.0.topk_ids: has shape [4, 3]"),
    ({**GOOD, "layers.0.topk_weights": torch.zeros((4, K))}, {},
     "layers.0.topk_ids: missing while topk_weights is present (add layers.0.topk_ids [T, topk=2], or leave "
     "layers.0.topk_weights out)"),
    ({**GOOD, "layers.0.extra": torch.zeros(1)}, {}, "layers.0.extra: unknown tensor name"),
    ({**GOOD, "layers.1.gating_output": torch.zeros((2, E + 1))}, {"num_layers": "2"}, "layers.1.gating_output: has 9"),
    (GOOD, {"topk": "9"}, "topk=9 must be in [1, num_experts=8]"),
    (GOOD, {"route_scale": "nan"}, "route_scale='nan' is not finite"),
    # a missing required key names the key to add and its meaning; the fix offered was "write traces with
    # routetool's writer", of no help to a trace written by hand from docs/trace-format.md
    (GOOD, {"route_scale": None}, "__metadata__: metadata key 'route_scale' is missing (add route_scale=<factor> to "
                                  "the metadata: the factor on the renormalised weights, routed_scaling_factor"),
    (GOOD, {"num_experts": None}, "__metadata__: metadata key 'num_experts' is missing (add num_experts=<E> to the "
                                  "metadata: E, the routed experts per layer: gating_output's columns"),
    (GOOD, {"topk": None}, "__metadata__: metadata key 'topk' is missing (add topk=<K> to the metadata: K, the "
                           "experts picked per token, 1 <= K <= num_experts"),
    # a missing format_version was "version None is not supported (upgrade routetool ...)": the wrong fix
    (GOOD, {"format_version": None}, "__metadata__: metadata key 'format_version' is missing (add "
                                     'format_version="1" to the metadata'),
    # a missing format was "metadata format=None, expected 'routetool-trace'"
    (GOOD, {"format": None}, "__metadata__: not a routetool trace: metadata key 'format' is missing (add "
                             'format="routetool-trace" to the metadata'),
    (GOOD, {"router_score_normalization": "tanh"}, "must be sigmoid, softmax, sqrtsoftplus or topk_then_softmax"),
    (GOOD, {"format": "other"}, "not a routetool trace (metadata format='other', expected 'routetool-trace') "
                                '(write format="routetool-trace" in a trace that follows docs/trace-format.md'),
    (GOOD, {"format_version": "9"}, "format version '9' is not supported (this routetool reads '1') (a trace that "
                                    'follows docs/trace-format.md says format_version="1"; for a trace of a newer '
                                    "format, upgrade routetool)"),
    (GOOD, {"num_layers": "3"}, "num_layers=3 but the file holds 1 layers (write num_layers=1, or leave the key out"),
    (GOOD, {"weights_semantics": "raw"}, "weights_semantics='raw' is not one of renormalized, unnormalized (write "
                                         "renormalized (route_scale * s_i / (sum of picked s + eps), the default) or "
                                         "unnormalized (route_scale * s_i)"),
    # a non-finite value: the fix says what the key accepts (it was "fix the metadata value")
    (GOOD, {"route_scale": "inf"}, "route_scale='inf' is not finite (write a finite number > 0"),
    (GOOD, {"router_output_multiplier": "nan"}, "router_output_multiplier='nan' is not finite (write a finite "
                                                "number, or leave the key out for no multiplier)"),
    (GOOD, {"router_score_division_eps": "-inf"}, "router_score_division_eps='-inf' is not finite (write a finite "
                                                  "number >= 0, or leave the key out for no eps)"),
    (GOOD, {"num_experts": "eight"}, "num_experts='eight' is not a plain decimal integer"),
    # Python's int()/float() accept underscores and any script's digits: "2_5" was read as 25
    (GOOD, {"route_scale": "2_5"}, "__metadata__: metadata route_scale='2_5' is not a plain decimal number "
                                   "(write the value as a plain decimal number (ASCII digits 0-9"),
    (GOOD, {"route_scale": "\u0662.\u0665"}, "route_scale='\u0662.\u0665' is not a plain decimal number"),
    (GOOD, {"router_score_division_eps": "1_0e-20"}, "router_score_division_eps='1_0e-20' is not a plain decimal"),
    (GOOD, {"router_output_multiplier": " 2"}, "router_output_multiplier=' 2' is not a plain decimal number"),
    # an empty value was read as an absent one: router_output_multiplier "" as none
    (GOOD, {"router_output_multiplier": ""}, "__metadata__: metadata router_output_multiplier='' is empty, not a "
                                             "number (write a plain decimal number, or leave the key out for none)"),
    (GOOD, {"router_score_division_eps": ""}, "metadata router_score_division_eps='' is empty, not a number"),
    (GOOD, {"route_scale": ""}, "metadata route_scale='' is empty, not a number (write a plain decimal number)"),
    (GOOD, {"topk": "\uff12"}, "topk='\uff12' is not a plain decimal integer"),
    # an integer key's fix gave 2.5 as an example of a plain decimal number
    (GOOD, {"topk": "2.5"}, "topk='2.5' is not a plain decimal integer (write the value as a plain decimal integer "
                            "(ASCII digits 0-9, e.g. 8; no decimal point"),
    (GOOD, {"num_experts": "0_8"}, "num_experts='0_8' is not a plain decimal integer"),
    (GOOD, {"num_layers": "\u0661"}, "num_layers='\u0661' is not a plain decimal integer"),
    # one layer under two names: the second silently replaced the first one's tensors
    ({**GOOD, "layers.00.gating_output": torch.ones((4, E))}, {},
     "layers.00.gating_output: layer index '00' has a leading zero (index 0 is written 0); the trace also holds "
     "layers.0.gating_output: two names for layer 0 (keep one of layers.0.gating_output and "
     "layers.00.gating_output; re-export the trace with routetool's writer)"),
    ({"layers.07.gating_output": torch.zeros((4, E))}, {},
     "layers.07.gating_output: layer index '07' has a leading zero (index 7 is written 7) (rename it "
     "layers.7.gating_output"),
    ({"layers.\u0663.gating_output": torch.zeros((4, E))}, {},
     "layers.\u0663.gating_output: layer index '\u0663' is not a plain decimal index (ASCII digits 0-9 only"),
    ({"layers.\uff13.gating_output": torch.zeros((4, E))}, {}, "layer index '\uff13' is not a plain decimal index"),
    ({"layers.1_0.gating_output": torch.zeros((4, E))}, {}, "layer index '1_0' is not a plain decimal index"),
    ({"layers.+1.gating_output": torch.zeros((4, E))}, {}, "layer index '+1' is not a plain decimal index"),
    ({"layers.x.gating_output": torch.zeros((4, E))}, {}, "layer index 'x' is not a non-negative integer"),
]


@pytest.mark.parametrize("tensors,meta,message", BROKEN)
def test_broken_traces(tensors, meta, message, raw_trace):
    path = raw_trace("bad.safetensors", tensors, **meta)
    with pytest.raises(RouteToolError) as info:
        Trace(path)
    text = str(info.value)
    assert str(path) in text and message in text, text
    assert "\n" not in text


def test_not_safetensors_truncated_missing(tmp_path, raw_trace):
    good = raw_trace("bad.safetensors", GOOD)
    data = good.read_bytes()
    cases = {
        "junk.safetensors": b"this is not a trace at all",
        "empty.safetensors": b"",
        "trunc.safetensors": data[:-40],
    }
    for name, content in cases.items():
        p = tmp_path / name
        p.write_bytes(content)
        with pytest.raises(RouteToolError, match="not a readable safetensors file"):
            Trace(p)
    with pytest.raises(RouteToolError, match="no such file"):
        Trace(tmp_path / "missing.safetensors")
    with pytest.raises(RouteToolError, match="is a directory"):
        Trace(tmp_path)


def test_a_path_that_is_not_utf8_is_named_as_such(tmp_path, raw_trace):
    # safetensors opens UTF-8 paths only: a good trace under such a name was called corrupt
    good = raw_trace("bad.safetensors", GOOD)
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9.safetensors")
    os.rename(good, odd)
    with pytest.raises(RouteToolError, match=r"path is not valid UTF-8, which safetensors cannot open \(rename") as info:
        Trace(odd)
    assert "not a readable safetensors file" not in str(info.value)


def test_format_name_is_stable():
    assert FORMAT_NAME == "routetool-trace"


def test_one_tensor_given_for_two_layers_is_written_once_per_layer(tmp_path):
    # safetensors refuses tensors that share storage: a RuntimeError traceback from write_trace
    layer = LayerArrays(gating_output=torch.randn(3, 4), step_offsets=torch.tensor([0, 3]))
    meta = TraceMeta(model="m", router=RouterConfig(num_experts=4, topk=2), provenance="p")
    path = write_trace(tmp_path / "t.safetensors", meta, {0: layer, 1: layer})
    with Trace(path) as t:
        assert t.layers == (0, 1)
        assert torch.equal(t.read_rows(0, 0, 3).gating_output, t.read_rows(1, 0, 3).gating_output)
