"""Importers of routing dumps, on small files shaped like the real ones in ../shared/realdata
(and on the real ones when present)."""

import json
import os
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch

from routetool.errors import RouteToolError
from routetool.io.dumps import (
    DEFAULT_DROP_REPEATS,
    ImportedCounts,
    ImportedRouting,
    ImportOptions,
    detect_format,
    read_dump,
    write_imported_trace,
)
from routetool.io.trace import Trace

REALDATA = Path(__file__).resolve().parents[3] / "shared" / "realdata"
needs_realdata = pytest.mark.skipif(not REALDATA.is_dir(), reason="../shared/realdata not present")


# -- look-alike writers ---------------------------------------------------------------------
def write_qwen_like(path: Path, dummy: int = 100, second_dummy: int = 70) -> list[list[int]]:
    """vLLM-hook JSONL: a meta row, a warm-up run of identical rows, real rows whose token_idx
    restarts at every forward step (steps of 3, 2, 2 tokens), another dummy run, one more step."""
    rows = [{"type": "meta", "model_id": "Qwen/Qwen1.5-MoE-A2.7B-Chat", "top_k": 4}]
    dummy_row = {"topk_ids": [43, 5, 7, 58], "topk_weights": [0.0967, 0.0518, 0.0391, 0.0367]}
    rows += [{"type": "route", "req_id": "r1", "token_idx": i, "layer": 0, **dummy_row} for i in range(dummy)]
    real = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 5, 9, 10], [2, 3, 4, 11], [12, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
            [0, 1, 2, 3]]
    steps = [3, 2, 2]
    k = 0
    for n in steps:
        for t in range(n):
            rows.append({"type": "route", "req_id": "r1", "token_idx": t, "layer": 0, "topk_ids": real[k],
                         "topk_weights": [0.4, 0.3, 0.2, 0.1]})
            k += 1
    rows += [{"type": "route", "req_id": "r1", "token_idx": i, "layer": 0, **dummy_row} for i in range(second_dummy)]
    rows.append({"type": "route", "req_id": "r1", "token_idx": 0, "layer": 0, "topk_ids": real[k],
                 "topk_weights": [0.4, 0.3, 0.2, 0.1]})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return real


def write_mixtral_like(path: Path) -> None:
    """HumanEval-hook JSONL: experts/gating_probs, per problem all tokens of layer 0, then layer 1."""
    rows = []
    ids = {0: [[6, 5], [5, 3], [7, 5]], 1: [[0, 3], [6, 2], [0, 3]]}
    for problem in (0, 1):
        for layer in (0, 1):
            for t, e in enumerate(ids[layer][: 2 + problem]):
                rows.append({"dataset": "humaneval", "problem_id": problem, "layer": layer, "experts": e,
                             "gating_probs": [0.7, 0.3], "token_idx": t})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


DS_HEADER = "Layer ID,Batch Number,Token,Activated Expert IDs\n"


def write_deepseek_like(folder: Path) -> None:
    """DeepSeek-V2-Lite CSVs: one file per prompt, layers 1..2, ids as a bracketed list (not sorted),
    tokens with commas quoted."""
    folder.mkdir()
    (folder / "prompt_2_data.csv").write_text(
        DS_HEADER
        + '1,0,"a, b","[8, 26, 56]"\n1,0,x,"[3, 14, 22]"\n2,0,"a, b","[3, 35, 38]"\n2,0,x,"[1, 2, 63]"\n'
        + '1,1,y,"[8, 9, 10]"\n2,1,y,"[0, 1, 2]"\n'
    )
    (folder / "prompt_10_data.csv").write_text(DS_HEADER + '1,0,z,"[60, 61, 62]"\n2,0,z,"[5, 6, 7]"\n')


# -- detection -------------------------------------------------------------------------------
def test_detect_format(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"topk_ids": [1]}\n')
    (tmp_path / "b.json").write_text('{\n "m": {"0": {"0": 1}}\n}\n')
    (tmp_path / "c.csv").write_text(DS_HEADER)
    (tmp_path / "d.pt").write_bytes(b"")
    (tmp_path / "e.log").write_text('{"topk_ids": [1]}\n{"topk_ids": [2]}\n')
    assert [detect_format(tmp_path / n) for n in ("a.jsonl", "b.json", "c.csv", "d.pt", "e.log")] == \
        ["jsonl", "counts-json", "csv", "sglang", "jsonl"]
    with pytest.raises(RouteToolError, match="no such file"):
        detect_format(tmp_path / "missing.jsonl")


# -- JSONL -------------------------------------------------------------------------------------
def test_qwen_like_drops_warmup_runs_and_splits_steps(tmp_path):
    path = tmp_path / "q.jsonl"
    real = write_qwen_like(path)
    r = read_dump(path, ImportOptions(num_experts=60))
    assert isinstance(r, ImportedRouting)
    assert (r.model, r.num_experts, r.topk) == ("Qwen/Qwen1.5-MoE-A2.7B-Chat", 60, 4)  # topk from the meta row
    assert (r.rows_read, r.rows_dropped, r.runs_dropped) == (178, 170, 2)
    layer = r.layers[0]
    assert layer.topk_ids.tolist() == real[:8]
    assert layer.step_offsets == [0, 3, 5, 7, 8]  # token_idx restarts = new forward step
    assert layer.topk_weights.shape == (8, 4)
    assert "dropped 170 warm-up/dummy rows: 2 run(s)" in r.notes[0]


def test_qwen_like_filters_are_options(tmp_path):
    path = tmp_path / "q.jsonl"
    write_qwen_like(path)
    kept = read_dump(path, ImportOptions(drop_repeats=0, num_experts=60))
    assert kept.num_tokens == 178 and kept.rows_dropped == 0
    skipped = read_dump(path, ImportOptions(drop_repeats=0, skip_rows=100, num_experts=60))
    assert skipped.num_tokens == 78 and skipped.rows_skipped == 100
    # a run exactly as long as the threshold is dropped; one row shorter is kept
    exact = read_dump(path, ImportOptions(drop_repeats=100, num_experts=60))
    assert (exact.rows_dropped, exact.runs_dropped) == (100, 1)
    assert read_dump(path, ImportOptions(drop_repeats=101, num_experts=60)).num_tokens == 178


def test_num_experts_inferred_with_a_note(tmp_path):
    path = tmp_path / "q.jsonl"
    write_qwen_like(path)
    r = read_dump(path)
    assert r.num_experts == 13  # largest real id is 12 once the dummy rows are gone
    assert any("inferred from the largest id (12)" in n for n in r.notes)


def test_mixtral_like_layers_and_problem_steps(tmp_path):
    path = tmp_path / "m.jsonl"
    write_mixtral_like(path)
    r = read_dump(path)
    assert (r.num_experts, r.topk) == (8, 2)
    assert sorted(r.layers) == [0, 1]
    assert r.layers[0].topk_ids.tolist() == [[6, 5], [5, 3], [6, 5], [5, 3], [7, 5]]
    assert r.layers[0].step_offsets == [0, 2, 5]  # problem 0 (2 tokens), problem 1 (3 tokens)
    assert r.layers[1].topk_weights[0].tolist() == pytest.approx([0.7, 0.3])


def test_jsonl_with_token_batches_per_line(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text(json.dumps({"layer": 3, "topk_ids": [[0, 1], [2, 3], [1, 2]]}) + "\n"
                    + json.dumps({"layer": 3, "topk_ids": [[0, 3]]}) + "\n")
    r = read_dump(path, ImportOptions(num_experts=4))
    assert r.layers[3].step_offsets == [0, 3, 4]


@pytest.mark.parametrize("lines, options, words", [
    (['{"topk_ids": [1, 2]}', "not json"], {}, "line 2: not JSON"),
    (['{"topk_ids": [1, 2]}', '{"topk_ids": [1, 2, 3]}'], {"topk": 2}, "line 2: 3 expert ids, expected topk=2"),
    (['{"topk_ids": [1, 1]}'], {}, "line 1: duplicate expert id"),
    (['{"topk_ids": [1, 9]}'], {"num_experts": 8}, "line 1: expert id 9 >= num_experts=8"),
    (['{"topk_ids": [1, -2]}'], {}, "line 1: negative expert id"),
    # without --topk, the first row of another width is named, with the first row (was: "rows have
    # different numbers of expert ids ([1, 2])", naming no line)
    (['{"topk_ids": [1, 2]}', '{"topk_ids": [3, 4]}', '{"topk_ids": [3]}'], {},
     r"line 3: 1 expert ids, where the first row \(line 1\) has 2 \(every row lists topk expert ids: fix the row, "
     r"or pass the model's --topk\)"),
    (['{"other": 1}'], {}, "no token rows left"),
    # parse failures that used to be tracebacks
    (['{"topk_ids": [1, 2]}', '{"topk_ids": []}'], {}, r"line 2: no expert ids \(an empty list\)"),
    (['{"topk_ids": [[1, 2], []]}'], {}, "line 1: no expert ids"),
    (['{"topk_ids": [1, 2, 3, 99999999999999999999999]}'], {}, "line 1: expert id 99999999999999999999999 is out of range"),
    (['{"topk_ids": 7}'], {}, "line 1: topk_ids is 7, not a list of expert ids"),
    # Python refuses integers of over 4,300 digits (a traceback); the strict reader reads 100 characters
    (['{"topk_ids": [1, ' + "9" * 5000 + ']}'], {}, "line 1: a number of 5,000 characters"),
    (['{"topk_ids": ' + "[" * 100000 + "]" * 100000 + '}'], {}, "line 1: arrays and objects nested deeper than 64"),
    # wrong numbers that used to be accepted silently
    (['{"topk_ids": [1.5, 2]}'], {}, "line 1: expert id 1.5 in topk_ids is not an integer"),
    (['{"topk_ids": [true, 2]}'], {}, "line 1: expert id true in topk_ids is not an integer"),
    (['{"topk_ids": [NaN, 2]}'], {}, "line 1: expert id NaN in topk_ids is not an integer"),
    (['{"topk_ids": [1, 2], "layer": 1.5}'], {}, "line 1: layer=1.5 is not a layer index"),
    (['{"topk_ids": [1, 2], "layer": true}'], {}, "line 1: layer=true is not a layer index"),
    (['{"topk_ids": [1, 2], "layer": 1e30}'], {}, "line 1: layer=1e.30 is not a layer index"),
    (['{"topk_ids": [1, 2], "layer_id": -1}'], {}, "line 1: layer_id=-1 is not a layer index"),
    (['{"topk_ids": [1, 2], "token_idx": 0}', '{"topk_ids": [1, 3], "token_idx": "a"}'], {},
     "line 2: token_idx=\"a\" is not an integer"),
    (['{"topk_ids": [1, 2], "topk_weights": [0.5, true]}'], {}, "line 1: topk_weights is not a list of numbers"),
    (['{"type": "meta", "num_experts": 99999999999}', '{"topk_ids": [1, 2]}'], {},
     "meta row: num_experts=99999999999 is not an integer in"),
    (['{"type": "meta", "top_k": true}', '{"topk_ids": [1, 2]}'], {}, "meta row: top_k=true"),
])
def test_jsonl_bad_input_names_file_and_line(tmp_path, lines, options, words):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RouteToolError, match=words) as info:
        read_dump(path, ImportOptions(**options))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_jsonl_integral_floats_are_integers(tmp_path):
    # 3.0 is the integer 3 (some writers emit floats); the layer likewise
    path = tmp_path / "f.jsonl"
    path.write_text('{"topk_ids": [3.0, 2], "layer": 2.0}\n')
    r = read_dump(path, ImportOptions(num_experts=4))
    assert r.layers[2].topk_ids.tolist() == [[3, 2]]


def _refused_in_one_line(path, text):
    """Write ``text`` to ``path``; the message of the one-line ``RouteToolError`` that reading it raises."""
    path.write_text(text)
    with pytest.raises(RouteToolError) as info:
        read_dump(path)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("line, words", [
    # numbers written as JSON strings used to be read as numbers, silently
    ('{"topk_ids": ["3", 1]}', 'line 1: expert id "3" in topk_ids is a string, not a JSON number (write expert ids '
                               'as numbers (3, without quotes); fix the dump\'s writer)'),
    ('{"topk_ids": [[1, 2], [3, "0"]]}', 'line 1: expert id "0" in topk_ids is a string, not a JSON number'),
    ('{"topk_ids": [1, 2], "layer": "0"}', 'line 1: layer="0" is a string, not a JSON number (write the layer as a '
                                           'number: "layer": 0, without quotes)'),
    ('{"topk_ids": [1, 2], "token_idx": "4"}', 'line 1: token_idx="4" is a string, not a JSON number'),
    ('{"type": "meta", "top_k": "2"}', 'meta row: top_k="2" is a string, not a JSON number'),
    # int() reads other scripts' digits: this was layer 3
    ('{"topk_ids": [1, 2], "layer": "\u0663"}', "line 1: layer='\u0663' is not a layer index"),
    # json.loads keeps the last of two equal keys: the ids [1, 2] were dropped silently
    ('{"topk_ids": [1, 2], "topk_ids": [3, 4]}', "line 1: the key 'topk_ids' appears twice in one object (JSON "
                                                 "readers differ on which value counts) (write each key once in each "
                                                 "object)"),
])
def test_jsonl_numbers_are_json_numbers_and_keys_unique(tmp_path, line, words):
    path = tmp_path / "s.jsonl"
    text = _refused_in_one_line(path, line + "\n" + '{"topk_ids": [0, 1]}\n')
    assert text.startswith(f"{path}: ") and words in text, text


@pytest.mark.parametrize("lines, words", [
    # two keys for one field: the first in the reader's list of names used to win silently
    (['{"topk_ids": [1, 2], "experts": [3, 4]}'],
     "line 1: the keys 'topk_ids' and 'experts' both give the expert ids (keep one of them (the reader takes the "
     "expert ids from one key))"),
    (['{"topk_ids": [1, 2], "topk_weights": [0.5, 0.5], "probs": [0.9, 0.1]}'],
     "line 1: the keys 'topk_weights' and 'probs' both give the weights"),
    (['{"topk_ids": [1, 2], "layer": 0, "layer_id": 1}'], "line 1: the keys 'layer' and 'layer_id' both give the layer"),
    (['{"topk_ids": [1, 2], "step": 0, "batch": 3}'], "line 1: the keys 'step' and 'batch' both give the step"),
    (['{"topk_ids": [1, 2], "token_idx": 0, "position": 7}'],
     "line 1: the keys 'token_idx' and 'position' both give the token index"),
    (['{"type": "meta", "top_k": 2, "num_experts_per_tok": 4}', '{"topk_ids": [1, 2]}'],
     "meta row: top_k=2 and num_experts_per_tok=4 disagree"),
    (['{"type": "meta", "num_experts": 8}', '{"type": "meta", "num_experts": 16}', '{"topk_ids": [1, 2]}'],
     "line 2: meta row says num_experts=16 but an earlier meta row said 8"),
])
def test_jsonl_two_keys_for_one_field_are_refused(tmp_path, lines, words):
    path = tmp_path / "k.jsonl"
    text = _refused_in_one_line(path, "\n".join(lines) + "\n")
    assert text.startswith(f"{path}: ") and words in text, text


def test_jsonl_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"topk_ids": [1, 2]}\n\xff\xfe{"topk_ids": [1, 2]}\n')
    with pytest.raises(RouteToolError, match=r"line 2: not UTF-8 text \(byte 1 of the line is 0xff\)"):
        read_dump(path)


def test_jsonl_utf8_bom_is_fine(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"topk_ids": [1, 2]}\n')
    assert read_dump(path).layers[0].topk_ids.tolist() == [[1, 2]]


@pytest.mark.parametrize("options, words", [
    ({"num_experts": 99999999999}, "--num-experts 99999999999 is out of range: at most 1,048,576"),
    ({"topk": 1 << 30}, "--topk 1073741824 is out of range"),
    ({"num_experts": 4, "topk": 8}, "--topk 8 > --num-experts 4"),
])
def test_option_bounds(tmp_path, options, words):
    # a huge --num-experts used to allocate [E]-sized tensors until memory ran out
    path = tmp_path / "q.jsonl"
    path.write_text('{"topk_ids": [1, 2]}\n')
    with pytest.raises(RouteToolError, match=words):
        read_dump(path, ImportOptions(**options))


@pytest.mark.parametrize("fmt, words", [
    ("trace", "--format trace does not match: this is not a routetool trace .its content looks like jsonl"),
    ("sglang", "is not a torch.save file"),
])
def test_wrong_format_says_so(tmp_path, fmt, words):
    path = tmp_path / "q.jsonl"
    path.write_text('{"topk_ids": [1, 2]}\n{"topk_ids": [0, 2]}\n')
    with pytest.raises(RouteToolError, match=words) as info:
        read_dump(path, ImportOptions(format=fmt))
    assert "already" not in str(info.value) and "\n" not in str(info.value)


def test_dump_format_on_a_trace_says_so(tmp_path):
    src = tmp_path / "m.jsonl"
    write_mixtral_like(src)
    out = tmp_path / "m.safetensors"
    write_imported_trace(read_dump(src), out)
    with pytest.raises(RouteToolError, match="--format jsonl does not match: this is a routetool trace"):
        read_dump(out, ImportOptions(format="jsonl"))
    with pytest.raises(RouteToolError, match="is already a routetool trace"):
        read_dump(out)


def test_any_other_parse_failure_is_one_line(tmp_path, monkeypatch):
    # last resort: a reader failing in an unforeseen way still gives one line naming the file
    from routetool.io import dumps as imports

    def broken(path, options):
        raise KeyError("records\nsecond line")

    monkeypatch.setattr(imports, "read_jsonl", broken)
    path = tmp_path / "q.jsonl"
    path.write_text('{"topk_ids": [1, 2]}\n')
    with pytest.raises(RouteToolError, match=r"cannot read as jsonl \(detected\) \(KeyError: 'records") as info:
        read_dump(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


# -- CSV ---------------------------------------------------------------------------------------
def test_deepseek_like_csv_folder(tmp_path):
    folder = tmp_path / "ds"
    write_deepseek_like(folder)
    r = read_dump(folder)
    assert r.format == "csv" and (r.num_experts, r.topk) == (64, 3)
    assert sorted(r.layers) == [1, 2]
    # natural file order (prompt_2 before prompt_10); steps: (prompt_2, batch 0), (prompt_2, batch 1), (prompt_10, 0)
    assert r.layers[1].topk_ids.tolist() == [[8, 26, 56], [3, 14, 22], [8, 9, 10], [60, 61, 62]]
    assert r.layers[1].step_offsets == [0, 2, 3, 4]
    assert r.layers[2].topk_weights is None


@pytest.mark.parametrize("body, words", [
    ('1,0,x,"[1.5, 2]"\n', r"line 2: expert id '1.5' in 'Activated Expert IDs' is not an integer"),
    ('1,0,x,"tensor([1, 2])"\n', "line 2: expert id 'tensor' in 'Activated Expert IDs' is not an integer"),
    ('-1,0,x,"[1, 2]"\n', "line 2: Layer ID='-1' is not a layer index"),
    ('1e30,0,x,"[1, 2]"\n', "line 2: Layer ID='1e30' is not a layer index"),
    ('1,0,x,"[]"\n', r"x.csv: line 2: no expert ids"),  # the file named once
    ('1,0,x,"[1, 99999999999999999999999]"\n', "line 2: expert id 99999999999999999999999 is out of range"),
    # an unclosed list was read as if closed: a cell cut short (its ids lost) passed silently
    ('1,0,x,"[1, 2"\n', re.escape("x.csv: line 2: the list '[1, 2' in 'Activated Expert IDs' is not closed (it opens with '[' "
                        "but does not end with ']') (close the list, e.g. \"[1, 2, 3]\"; a cell cut short has lost "
                        "ids, so re-export the dump)")),
    ('1,0,x,"(1, 2]"\n', re.escape("line 2: the list '(1, 2]' in 'Activated Expert IDs' is not closed")),
    ('1,0,x,"1, 2]"\n', re.escape("line 2: the list '1, 2]' in 'Activated Expert IDs' has unbalanced or nested")),
    ('1,0,x,"[[1, 2]]"\n', re.escape("line 2: the list '[[1, 2]]' in 'Activated Expert IDs' has unbalanced or")),
    # an unclosed quote runs on: the cell holds the next line too
    ('1,0,x,"[1, 2\n1,1,y,[3, 4]\n', re.escape("line 3: the 'Activated Expert IDs' cell runs over 2 lines (its quote "
                                                "is not closed where the line ends)")),
])
def test_csv_wrong_numbers(tmp_path, body, words):
    # "[1.5, 2]" used to be read as the ids 1, 5, 2
    path = tmp_path / "x.csv"
    path.write_text(DS_HEADER + body)
    with pytest.raises(RouteToolError, match=words) as info:
        read_dump(path)
    assert str(info.value).count("x.csv") == 1


@pytest.mark.parametrize("body, words", [
    # "0" and "00" were one layer under two names
    ('0,0,x,"[1, 2]"\n00,0,y,"[1, 3]"\n', "x.csv: line 3: Layer ID='00' and '0' (line 2) name the same layer 0 "
                                          "(spell each layer one way in the whole dump (e.g. 0))"),
    # int() reads Arabic-Indic and fullwidth digits: these were layer 3 and expert 2
    ('\u0663,0,x,"[1, 2]"\n', "x.csv: line 2: Layer ID='\u0663' is not a plain decimal layer index"),
    # surrounding spaces were stripped: "1", " 1" and "1 " became one layer (docs: " 1" is an error)
    ('1,0,x,"[1, 2]"\n 1,0,y,"[1, 3]"\n', ("x.csv: line 3: Layer ID=' 1' is not a plain decimal layer index (write "
                                           "the layer in ASCII digits 0-9, without spaces, underscores or other "
                                           "scripts' digits)")),
    ('1 ,0,x,"[1, 2]"\n', "x.csv: line 2: Layer ID='1 ' is not a plain decimal layer index"),
    ('\t1,0,x,"[1, 2]"\n', "x.csv: line 2: Layer ID='\\t1' is not a plain decimal layer index"),
    ('1_0,0,x,"[1, 2]"\n', "x.csv: line 2: Layer ID='1_0' is not a plain decimal layer index"),
    ('1,0,x,"[1, \uff12]"\n', "x.csv: line 2: expert id '\uff12' in 'Activated Expert IDs' is not an integer"),
    ('1,0,x,"[1, 2_0]"\n', "x.csv: line 2: expert id '2_0' in 'Activated Expert IDs' is not an integer"),
])
def test_csv_layers_and_ids_are_plain_and_spelled_once(tmp_path, body, words):
    text = _refused_in_one_line(tmp_path / "x.csv", DS_HEADER + body)
    assert words in text, text


@pytest.mark.parametrize("header, words", [
    # the first column in the reader's list of names used to win silently
    ("Layer ID,Batch Number,topk_ids,Activated Expert IDs\n",
     "x.csv: line 1: the columns 'topk_ids' and 'Activated Expert IDs' both give the expert ids (keep one of them "
     "(rename or drop the other column))"),
    ("layer,Layer ID,Batch Number,Activated Expert IDs\n", "the columns 'layer' and 'Layer ID' both give the layer"),
    ("Layer ID,Batch Number,step,Activated Expert IDs\n", "the columns 'Batch Number' and 'step' both give the step"),
    ("Layer ID,topk_ids,Activated Expert IDs,weights\n", "the columns 'topk_ids' and 'Activated Expert IDs' both"),
    ("Layer ID,Batch Number,topk_ids,topk_ids\n", "the columns 'topk_ids' and 'topk_ids' both give the expert ids"),
])
def test_csv_two_columns_for_one_field_are_refused(tmp_path, header, words):
    text = _refused_in_one_line(tmp_path / "x.csv", header + '1,0,"[1, 2]","[3, 4]"\n')
    assert words in text, text


def test_csv_folder_layer_spelled_two_ways_names_both_files(tmp_path):
    (tmp_path / "a.csv").write_text(DS_HEADER + '1,0,x,"[1, 2]"\n')
    (tmp_path / "b.csv").write_text(DS_HEADER + '01,0,x,"[1, 3]"\n')
    with pytest.raises(RouteToolError, match=r"b.csv: line 2: Layer ID='01' and '1' \(a.csv line 2\) name the same "
                                             r"layer 1"):
        read_dump(tmp_path)


def test_csv_weights_are_plain_decimals(tmp_path):
    # float("0_5") is 5.0
    path = tmp_path / "w.csv"
    path.write_text('layer,topk_ids,topk_weights\n0,"[1, 2]","[0_5, 0.5]"\n')
    with pytest.raises(RouteToolError, match=r"w.csv: line 2: weight '0_5' in 'topk_weights' is not a number"):
        read_dump(path)
    path.write_text('layer,topk_ids,topk_weights\n0,"[1, 2]","[0.5, 1e-1]"\n')
    assert read_dump(path).layers[0].topk_weights[0].tolist() == pytest.approx([0.5, 0.1])


# non-finite and negative weights were written into the trace ("wrote ... (ids-only trace)", exit 0),
# and replay later failed the file; they are refused where they are read
@pytest.mark.parametrize("cell, words", [
    ("nan", "weight 'nan' in 'topk_weights' is not a finite number"),
    ("inf", "weight 'inf' in 'topk_weights' is not a finite number"),
    ("-inf", "weight '-inf' in 'topk_weights' is not a finite number"),
    ("1e400", ("weight '1e400' in 'topk_weights' is not a finite number (weights must be finite and >= 0; a number "
               "beyond the float range, like 1e400, is infinite; fix the row)")),
    ("1e39", "weight '1e39' in 'topk_weights' is too large for a float32 weight (at most 3.403e+38)"),
    ("-1", "weight '-1' in 'topk_weights' is negative (weights must be finite and >= 0; fix the row)"),
    ("-0.25", "weight '-0.25' in 'topk_weights' is negative"),
])
def test_csv_weights_are_finite_and_not_negative(tmp_path, cell, words):
    path = tmp_path / "w.csv"
    path.write_text(f'layer,topk_ids,topk_weights\n0,"[1, 2]","[0.5, 0.5]"\n0,"[1, 3]","[0.5, {cell}]"\n')
    with pytest.raises(RouteToolError) as info:
        read_dump(path)
    assert str(info.value).startswith(f"{path}: line 3: {words}"), str(info.value)


@pytest.mark.parametrize("weights, words", [
    ("[0.5, NaN]", "weight NaN in 'topk_weights' is not a finite number"),
    ("[0.5, Infinity]", "weight Infinity in 'topk_weights' is not a finite number"),
    ("[1e400, 0.5]", ("weight Infinity in 'topk_weights' is not a finite number (weights must be finite and >= 0; "
                      "a number beyond the float range, like 1e400, is infinite")),
    ("[0.5, -1]", "weight -1 in 'topk_weights' is negative (weights must be finite and >= 0; fix the row)"),
    ("[[0.5, 0.5], [0.5, -1e-3]]", "weight -0.001 in 'topk_weights' is negative"),  # a batch of token rows
    ("[0.5, 1" + "0" * 400 + "]", "a number of 401 characters"),  # (float() made it inf)
])
def test_jsonl_weights_are_finite_and_not_negative(tmp_path, weights, words):
    path = tmp_path / "w.jsonl"
    ids = "[[1, 2], [1, 3]]" if weights.startswith("[[") else "[1, 2]"
    path.write_text('{"topk_ids": [1, 2], "topk_weights": [0.5, 0.5]}\n'
                    f'{{"topk_ids": {ids}, "topk_weights": {weights}}}\n')
    with pytest.raises(RouteToolError) as info:
        read_dump(path)
    assert str(info.value).startswith(f"{path}: line 2: {words}"), str(info.value)


def test_zero_and_tiny_weights_are_kept(tmp_path):
    # 0, -0.0 and subnormal weights are finite and not negative
    path = tmp_path / "w.jsonl"
    path.write_text('{"topk_ids": [1, 2], "topk_weights": [-0.0, 1e-320]}\n{"topk_ids": [1, 3], "topk_weights": [0, 1]}\n')
    assert read_dump(path).layers[0].topk_weights.tolist() == [[0.0, 0.0], [0.0, 1.0]]


def test_csv_folder_names_the_file_of_a_bad_row(tmp_path):
    (tmp_path / "a.csv").write_text(DS_HEADER + '1,0,x,"[1, 2]"\n')
    (tmp_path / "b.csv").write_text(DS_HEADER + '1,0,x,"[]"\n')
    with pytest.raises(RouteToolError, match="b.csv line 2: no expert ids"):
        read_dump(tmp_path)


def test_csv_folder_row_widths_name_both_files_and_lines(tmp_path):
    # was "rows have different numbers of expert ids ([3, 6])", naming neither file nor line
    (tmp_path / "a.csv").write_text(DS_HEADER + '1,0,x,"[1, 2, 3, 4, 5, 6]"\n1,0,y,"[2, 3, 4, 5, 6, 7]"\n')
    (tmp_path / "z.csv").write_text(DS_HEADER + '1,0,x,"[1, 2, 3]"\n')
    with pytest.raises(RouteToolError) as exc:
        read_dump(tmp_path)
    assert str(exc.value) == (f"{tmp_path}: z.csv line 2: 3 expert ids, where the first row (a.csv line 2) has 6 "
                              "(every row lists topk expert ids: fix the row, or pass the model's --topk)")
    # with --topk the row is named against it, as before
    with pytest.raises(RouteToolError, match="z.csv line 2: 3 expert ids, expected topk=6"):
        read_dump(tmp_path, ImportOptions(topk=6))


def test_csv_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "x.csv"
    path.write_bytes(DS_HEADER.encode() + b'1,0,x,"[1, 2]"\n1,0,\xff,"[1, 3]"\n')
    with pytest.raises(RouteToolError, match="line 3: not UTF-8 text"):
        read_dump(path)


def test_csv_without_id_column(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("layer,foo\n0,1\n")
    with pytest.raises(RouteToolError, match="no expert-id column"):
        read_dump(path)


# -- SGLang .pt dumps ----------------------------------------------------------------------
def write_sglang_stat(path: Path) -> torch.Tensor:
    """stat mode: logical_count [buffer steps, layers, experts]; an unfilled buffer slot is all zero;
    layer 0 is dense (no routed tokens)."""
    lc = torch.zeros(4, 3, 8, dtype=torch.int32)
    lc[0, 1] = torch.tensor([4, 0, 1, 1, 0, 0, 1, 1])
    lc[0, 2] = torch.tensor([2, 2, 2, 2, 0, 0, 0, 0])
    lc[1, 1] = torch.tensor([0, 0, 0, 0, 2, 2, 2, 2])
    lc[1, 2] = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1])
    lc[3, 1] = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1])
    lc[3, 2] = torch.tensor([8, 0, 0, 0, 0, 0, 0, 0])
    torch.save({"rank": 0, "logical_count": lc, "average_utilization_rate_over_window": None}, path)
    return lc


def write_sglang_per_token(path: Path) -> None:
    """per_token mode: records with topk_ids_of_layer [layers, tokens, 8] of *physical* ids (-1 unused
    columns beyond topk=2), and last_physical_to_logical_map [layers, 6] (E=4 + 2 replicas)."""
    phys_map = torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 3, 3]])

    def ids(rows):
        t = torch.full((2, len(rows[0]), 8), -1, dtype=torch.int32)
        for layer in range(2):
            for i, r in enumerate(rows[layer]):
                t[layer, i, : len(r)] = torch.tensor(r)
        return t

    records = [
        {"forward_pass_id": 0, "rank": 0, "gatherer_key": "primary", "input_ids": [1, 2], "positions": [0, 1],
         "extend_seq_lens": [2], "forward_mode": 1, "misc_objects": [],
         "topk_ids_of_layer": ids([[[0, 5], [4, 2]], [[4, 1], [5, 2]]]),
         "global_physical_count": torch.zeros(2, 6, dtype=torch.int32)},
        {"forward_pass_id": 1, "rank": 0, "gatherer_key": "primary", "input_ids": [3], "positions": [2],
         "extend_seq_lens": [1], "forward_mode": 2, "misc_objects": [],
         "topk_ids_of_layer": ids([[[3, 2]], [[0, 3]]]),
         "global_physical_count": torch.zeros(2, 6, dtype=torch.int32)},
    ]
    torch.save({"records": records, "last_physical_to_logical_map": phys_map}, path)


def test_sglang_stat_dump(tmp_path):
    path = tmp_path / "expert_distribution_recorder_1.pt"
    lc = write_sglang_stat(path)
    r = read_dump(path)
    assert isinstance(r, ImportedCounts) and r.num_experts == 8
    assert sorted(r.layers) == [1, 2]  # dense layer 0 left out
    assert r.layers[1].tolist() == [lc[0, 1].tolist(), lc[1, 1].tolist(), lc[3, 1].tolist()]  # empty slot 2 dropped
    assert any("1 empty steps" in n for n in r.notes)


@pytest.mark.parametrize("lc, words", [
    ([[[1, -2, 3]]], r"logical_count\[0, 0, 1\] is -2: counts cannot be negative"),
    (torch.tensor([[[1.0, float("nan"), 3.0]]]), r"logical_count\[0, 0, 1\] is nan: expert counts must be finite"),
    (torch.tensor([[[1.0, 2.5, 3.0]]]), r"logical_count\[0, 0, 1\] is 2.5"),
    ("abc", "logical_count is not a numeric tensor"),
])
def test_sglang_stat_bad_counts(tmp_path, lc, words):
    # a negative count used to give Gini 1.67 and entropy -0.24
    path = tmp_path / "stat.pt"
    torch.save({"logical_count": lc}, path)
    with pytest.raises(RouteToolError, match=words) as info:
        read_dump(path)
    assert str(path) in str(info.value)


def test_sglang_per_token_bad_ids(tmp_path):
    path = tmp_path / "pt.pt"
    ids = torch.full((1, 1, 8), -1, dtype=torch.int32)
    ids[0, 0, :2] = torch.tensor([0, -5])
    torch.save({"records": [{"forward_pass_id": 0, "topk_ids_of_layer": ids}]}, path)
    with pytest.raises(RouteToolError, match=r"topk_ids_of_layer\[0, 0, 1\] is -5"):
        read_dump(path)
    torch.save({"records": [{"forward_pass_id": 0, "rank": 0}]}, path)
    with pytest.raises(RouteToolError, match="neither topk_ids_of_layer nor global_physical_count"):
        read_dump(path)


def test_sglang_per_token_dump_maps_physical_to_logical(tmp_path):
    path = tmp_path / "expert_distribution_recorder_1_0.pt"
    write_sglang_per_token(path)
    r = read_dump(path)
    assert isinstance(r, ImportedRouting) and (r.num_experts, r.topk) == (4, 2)
    # layer 0 map [0,1,2,3,0,1]: [0,5]->[0,1], [4,2]->[0,2], [3,2]->[3,2]
    assert r.layers[0].topk_ids.tolist() == [[0, 1], [0, 2], [3, 2]]
    # layer 1 map [0,1,2,3,3,3]: [4,1]->[3,1], [5,2]->[3,2], [0,3]->[0,3]
    assert r.layers[1].topk_ids.tolist() == [[3, 1], [3, 2], [0, 3]]
    assert r.layers[0].step_offsets == [0, 2, 3]  # one step per forward pass


def test_sglang_per_pass_dump_gives_counts(tmp_path):
    path = tmp_path / "pp.pt"
    g = torch.tensor([[1, 0, 0, 0, 2, 0], [0, 0, 0, 1, 1, 1]], dtype=torch.int32)
    torch.save({"records": [{"forward_pass_id": 0, "rank": 0, "global_physical_count": g}],
                "last_physical_to_logical_map": torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 3, 3]])}, path)
    r = read_dump(path)
    assert isinstance(r, ImportedCounts)
    assert r.layers[0].tolist() == [[3, 0, 0, 0]] and r.layers[1].tolist() == [[0, 0, 0, 3]]


def test_not_an_sglang_dump(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(RouteToolError, match="not an SGLang expert-distribution dump"):
        read_dump(path)
    path.write_bytes(b"garbage")
    with pytest.raises(RouteToolError, match="not a torch.save file"):
        read_dump(path)
    path.write_bytes(b"PK\x03\x04garbage")  # looks like a zip, is not one: torch.load's message, one line
    with pytest.raises(RouteToolError, match="weights_only=True") as info:
        read_dump(path)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_a_refused_pickle_is_one_error_and_no_torch_warning(tmp_path):
    # torch.load warns about a pickle protocol other than 2 (on stderr, with its own file name)
    path = tmp_path / "e.pt"
    path.write_bytes(pickle.dumps(os.getcwd, protocol=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RouteToolError, match="weights_only=True"):
            read_dump(path)
    assert [str(w.message) for w in caught] == []


# -- counts JSON --------------------------------------------------------------------------------
def _counts_doc():
    return {
        "mixtral": {"arxiv": {"0": {str(e): 10 + e for e in range(8)}, "7": {str(e): 5 for e in range(8)}},
                    "book": {"0": {str(e): 20 for e in range(8)}, "7": {str(e): 1 + e for e in range(8)}}},
        "olmoe": {"arxiv": {"0": {str(e): 3 for e in range(64)}}},
    }


def test_counts_json_select_model_and_domain(tmp_path):
    path = tmp_path / "counts.json"
    path.write_text(json.dumps(_counts_doc(), indent=1))
    with pytest.raises(RouteToolError, match="several models in one file.*--select"):
        read_dump(path)
    r = read_dump(path, ImportOptions(select="mixtral"))
    assert isinstance(r, ImportedCounts) and r.num_experts == 8 and r.model == "mixtral"
    assert r.step_labels == ["arxiv", "book"]
    assert r.layers[0].tolist() == [[10 + e for e in range(8)], [20] * 8]
    one = read_dump(path, ImportOptions(select="mixtral/book"))
    assert one.layers[7].tolist() == [[1 + e for e in range(8)]]
    with pytest.raises(RouteToolError, match="matches no table"):
        read_dump(path, ImportOptions(select="switch"))


def test_reading_options_a_format_does_not_use_are_refused(tmp_path):
    # skip_rows and drop_repeats filter token rows: on counts they were ignored silently
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"0": [1, 2, 3]}))
    with pytest.raises(RouteToolError) as info:
        read_dump(path, ImportOptions(skip_rows=5))  # without `given`: the options off their defaults
    assert str(info.value) == (f"{path}: --skip-rows does not apply to a counts-json file of per-expert counts (it "
                               "reads --num-experts, --topk, --select) (drop --skip-rows)")
    defaults = ImportOptions(skip_rows=0, drop_repeats=DEFAULT_DROP_REPEATS)
    assert read_dump(path, defaults).layers[0].tolist() == [[1, 2, 3]]
    with pytest.raises(RouteToolError, match="--drop-repeats does not apply"):  # given, at its default value
        read_dump(path, ImportOptions(given=frozenset({"drop_repeats"})))
    q = tmp_path / "q.jsonl"
    q.write_text('{"topk_ids": [1, 2]}\n')
    with pytest.raises(RouteToolError, match="--select does not apply to a jsonl dump"):
        read_dump(q, ImportOptions(select="x"))


def test_counts_json_list_form(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"0": [1, 2, 3], "5": [0, 0, 9]}))
    r = read_dump(path, ImportOptions(topk=1))
    assert r.layers[5].tolist() == [[0, 0, 9]] and r.topk == 1


def test_counts_json_topk_above_the_inferred_experts(tmp_path):
    # --topk 4 with 3 experts used to be accepted (tokens = assignments / 4)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"0": [1, 2, 3], "5": [0, 0, 9]}))
    with pytest.raises(RouteToolError) as info:
        read_dump(path, ImportOptions(topk=4))
    assert str(info.value) == (f"{path}: --topk 4 is more than the 3 experts inferred from the counts (largest expert "
                               "id + 1) (pass the model's --topk (at most 3), or --num-experts if the model has experts "
                               "the file never names)")
    assert read_dump(path, ImportOptions(topk=3)).topk == 3
    assert read_dump(path, ImportOptions(topk=4, num_experts=8)).num_experts == 8


def test_counts_json_bad_count(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"0": {"0": -1, "1": 2}}))
    with pytest.raises(RouteToolError, match="not a non-negative integer"):
        read_dump(path)


@pytest.mark.parametrize("text, words", [
    ('{"m":{"d":{"0":{"0":5,"1":NaN}}}}', r"m/d/0: expert 1 count NaN is not a finite number"),
    ('{"m":{"d":{"0":{"0":5,"1":Infinity}}}}', r"m/d/0: expert 1 count Infinity is not a finite number"),
    ('{"m":{"d":{"0":{"0":5,"1":1.5}}}}', r"m/d/0: expert 1 count 1.5 is not a non-negative integer"),
    ('{"m":{"d":{"0":{"0":5,"1":1e300}}}}', r"m/d/0: expert 1 count 1e\+300 is too large"),
    ('{"m":{"d":{"0":{"-1":5,"1":2}}}}', r"m/d/0: expert id -1 is out of range"),
    ('{"m":{"d":{"0":{"99999999999":5}}}}', r"m/d/0: expert id 99999999999 is out of range"),
    ('{"m":{"d":{"-1":{"0":5,"1":2}}}}', r"m/d: layer '-1' is not a layer index"),
    ('{"m":{"d":{"0":{}}}}', r"no \{layer: \{expert_id: count\}\} tables found"),
    ('{"m": [1, 2', r"line 1: not JSON"),
    ('{"0":[5,3,0,2],"1":[1,2]}', r"top level: layer 1 lists 2 expert counts, layer 0 4"),
    # a map beside lists: its experts 1-3 used to be padded with zeros
    ('{"0":[5,3,0,2],"1":{"0":1}}', r"top level: layer 0 is a list of counts but layer 1 a \{expert_id: count\} map: "
                                   r"one table must use one form \(give every layer a list of one count per expert, "
                                   r"or every layer a map\)"),
    ('{"m":{"d":{"3":{"0":1,"1":2},"7":[1,2,3,4]}}}', r"m/d: layer 7 is a list of counts but layer 3 a"),
    # two spellings of one layer or expert: the later one's counts silently replaced the earlier's
    ('{"0":[5,3],"00":[1,2]}', r"top level: keys '0' and '00' name the same layer 0 \(keep one key per layer "
                               r"\(e.g. 0\), with all of its counts\)"),
    ('{"m":{"7":{"1":5,"01":3}}}', r"m/7: keys '1' and '01' name the same expert 1"),
    ('{"m":{"1":5,"01":3}}', r"m: keys '1' and '01' name the same expert 1"),
    ('{"0":[5,3],"0":[1,2]}', r"the key '0' appears twice in one object \(JSON readers differ on which value counts\)"),
    # int() reads "1_0" as 10 and other scripts' digits as digits
    ('{"1_0":[5,3]}', r"top level: key '1_0' is not a plain decimal layer \(ASCII digits 0-9 only\)"),
    ('{"m":{"0":{"\u0663":5}}}', r"m/0: key '\u0663' is not a plain decimal expert"),
])
def test_counts_json_bad_numbers_name_the_key(tmp_path, text, words):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(RouteToolError, match=words) as info:
        read_dump(path)
    assert str(path) in str(info.value)


def test_counts_json_not_utf8(tmp_path):
    path = tmp_path / "c.json"
    path.write_bytes(b'{"m":\n {"0": [1, 2]}, "\xff": 1}')
    with pytest.raises(RouteToolError, match="line 2: not UTF-8 text"):
        read_dump(path)


# -- writing an ids-only trace ----------------------------------------------------------------
def test_import_writes_ids_only_trace(tmp_path):
    src = tmp_path / "m.jsonl"
    write_mixtral_like(src)
    r = read_dump(src)
    out = tmp_path / "m.safetensors"
    write_imported_trace(r, out)
    with Trace(out) as t:
        assert t.layers == (0, 1) and t.meta.router.num_experts == 8 and t.meta.router.topk == 2
        info = t.info(0)
        assert not info.has_logits and info.has_recorded_ids and info.step_offsets == (0, 2, 5)
        steps = list(t.steps(0))
        assert torch.cat([s.recorded_ids for s in steps]).tolist() == r.layers[0].topk_ids.tolist()
        assert t.meta.extra["import_format"] == "jsonl"
    with pytest.raises(RouteToolError, match="already exists"):
        write_imported_trace(r, out)
    write_imported_trace(r, out, force=True)


# -- the real files, when present ----------------------------------------------------------------
@needs_realdata
def test_real_qwen_warmup_rows_dropped():
    r = read_dump(REALDATA / "qwen1.5-moe-a2.7b-chat.layer0.gsm8k.jsonl", ImportOptions(num_experts=60))
    assert (r.rows_read, r.rows_dropped, r.runs_dropped, r.num_tokens) == (18818, 16384, 2, 2434)
    assert r.topk == 4 and r.layers[0].num_steps > 50


@needs_realdata
def test_real_olmoe_and_mixtral_and_deepseek():
    o = read_dump(REALDATA / "olmoe-1b-7b.layer0.gsm8k.jsonl")
    assert (o.num_experts, o.topk, o.num_tokens, o.rows_dropped) == (64, 8, 4471, 2048)
    m = read_dump(REALDATA / "mixtral-8x7b-instruct.all-layers.humaneval.jsonl")
    assert (m.num_experts, m.topk, len(m.layers), m.rows_dropped) == (8, 2, 32, 0)
    d = read_dump(REALDATA / "deepseek-v2-lite-expert-ids")
    assert (d.num_experts, d.topk, sorted(d.layers)) == (64, 6, list(range(1, 27)))
    assert all(x.num_tokens == d.layers[1].num_tokens for x in d.layers.values())


@needs_realdata
def test_real_counts_json():
    c = read_dump(REALDATA / "expert-counts.olmoe-paper.json", ImportOptions(select="mixtral-8x7b-v0.1", topk=2))
    assert c.num_experts == 8 and sorted(c.layers) == [0, 7, 15] and len(c.step_labels) == 5
    # 208,896 tokens per domain, top-2
    assert int(c.layers[0][0].sum()) == 2 * 208_896
