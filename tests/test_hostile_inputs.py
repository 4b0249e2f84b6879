"""Hostile input, each hole closed at its mechanism (docs/cli-contract.md): the one path check
(routetool.files.path_kind) and the strict JSON reader (routetool.jsonstrict), safetensors
headers included."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import routetool
from routetool.cli import main
from routetool.errors import RouteToolError
from routetool.files import check_output_paths, path_kind
from routetool.jsonstrict import MAX_DEPTH, DuplicateKey, JSONProblem, NumberTooLong, TooDeep, loads

ROOT = Path(routetool.__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"


def _run(*args):
    result = CliRunner().invoke(main, [*map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("routetool: error: "), result.stderr
    return lines[0]


# -- the one path check -------------------------------------------------------------------------
def test_a_symlink_loop_or_a_nul_byte_is_one_line_wherever_a_path_is_checked(tmp_path):
    os.symlink(tmp_path / "b.json", tmp_path / "a.json")
    os.symlink(tmp_path / "a.json", tmp_path / "b.json")
    loop = tmp_path / "a.json"
    # hole 3: an output path that is a loop (Path.resolve raised RuntimeError)
    line = _one_line_error(_run("info", TRACE, "--json", loop))
    assert line == (f"routetool: error: {loop}: a symbolic link on this path points in a loop (make the link point to "
                    "a file or folder, or name another path)")
    # an input that is a loop, with and without an output
    for args in (["info", loop], ["info", loop, "--json", tmp_path / "o.json"], ["balance", loop, "--no-progress"]):
        assert "points in a loop" in _one_line_error(_run(*args))
    # hole 4: a NUL byte in a shard path, with any output option (ValueError: embedded null byte)
    index = tmp_path / "run.json"
    index.write_text('{"format": "routetool-trace-index", "version": "1", "shards": [{"path": "x\\u0000.safetensors"}]}')
    for args in (["info", index, "--json", tmp_path / "o.json"], ["info", index],
                 ["balance", index, "--no-progress", "--json", tmp_path / "o.json"]):
        assert "the path holds a NUL byte, which no file name can" in _one_line_error(_run(*args))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json", "run.json"]


def test_path_kind_names_what_is_there(tmp_path):
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    os.mkfifo(tmp_path / "fifo")
    assert [path_kind(tmp_path / n) for n in ("missing", "dangling", "fifo")] == ["missing", "dangling link", "special"]
    assert path_kind(TRACE) == "file" and path_kind(tmp_path) == "folder"
    assert path_kind(TRACE / "below.json") == "missing"  # (a file where a folder belongs: the output check names it)
    with pytest.raises(RouteToolError, match="the name is too long for the file system"):
        path_kind(tmp_path / ("x" * 300))
    with pytest.raises(RouteToolError, match="NUL byte"):
        check_output_paths([tmp_path / "o.json"], force=False, inputs=[f"{tmp_path}/a\0b"])


# -- the strict JSON reader ----------------------------------------------------------------------
@pytest.mark.parametrize("text, problem, words", [
    ("[" * 100_000 + "]" * 100_000, TooDeep, f"nested deeper than {MAX_DEPTH} levels"),  # was a RecursionError
    ('{"a": ' + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "}", None, ""),  # as deep as allowed
    ('{"a": "' + "[" * 1000 + '"}', None, ""),  # brackets in a string are no nesting
    ('{"n": ' + "9" * 5000 + "}", NumberTooLong, "a number of 5,000 characters"),  # was a ValueError (4,300 digits)
    ('{"n": 1.' + "5" * 200 + "}", NumberTooLong, "a number of 202 characters"),
    ('{"a": 1, "a": 2}', DuplicateKey, "the key 'a' appears twice in one object"),
    ('{"a": 1,\n"b": }', JSONProblem, "not JSON (Expecting value)"),
])
def test_the_strict_reader(text, problem, words):
    if problem is None:
        assert isinstance(loads(text), dict)
        return
    with pytest.raises(problem) as info:
        loads(text)
    assert words in info.value.reason


DEEP = "[" * 100_000 + "]" * 100_000  # hole 1
LONG = ('{"format": "routetool-trace-index", "version": "1", "shards": [{"path": "a", "size_bytes": ' + "9" * 5000
        + "}]}")  # hole 2
COUNTS_LONG = '{"0": {"0": ' + "9" * 5000 + "}}"


@pytest.mark.parametrize("content, command, words", [
    (DEEP, ["info"], "index: line 1: arrays and objects nested deeper than 64 levels"),
    (DEEP, ["balance", "--no-progress", "--format", "counts-json"], "line 1: arrays and objects nested deeper than 64"),
    (DEEP, ["import", "--format", "counts-json", "-o", "OUT"], "line 1: arrays and objects nested deeper than 64"),
    (LONG, ["info"], "index: a number of 5,000 characters (999999999999...): at most 100 are read"),
    (LONG, ["balance", "--no-progress"], "index: a number of 5,000 characters"),
    (COUNTS_LONG, ["balance", "--no-progress"], "a number of 5,000 characters"),
])
def test_deep_json_and_long_numbers_are_one_line_errors(tmp_path, content, command, words):
    path = tmp_path / "d.json"
    path.write_text(content)
    args = [str(tmp_path / "o.safetensors") if a == "OUT" else a for a in command]
    line = _one_line_error(_run(args[0], path, *args[1:]))
    assert line.startswith(f"routetool: error: {path}: {words}"), line


@pytest.mark.parametrize("where", ["metadata", "tensor"])
def test_a_key_twice_in_a_safetensors_header_is_refused(tmp_path, where):
    # hole 7: the library keeps the last; route_scale twice decided PASS or FAIL by order
    import struct

    data = TRACE.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + n].decode()
    if where == "metadata":
        header = header.replace('"__metadata__":{', '"__metadata__":{"route_scale":"9.0",', 1)
        key = "route_scale"
    else:
        doc = json.loads(header)
        key = next(k for k in doc if k.endswith(".bias"))
        header = header.rstrip()[:-1] + f',"{key}":{json.dumps(doc[key])}' + "}"
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    for command in (["info"], ["replay", "--device", "cpu", "--no-latency", "--no-progress"]):
        line = _one_line_error(_run(command[0], path, *command[1:]))
        assert line == (f"routetool: error: {path}: header: the key {key!r} appears twice in one object (JSON readers "
                        "differ on which value counts) (write each key once in each object)")
