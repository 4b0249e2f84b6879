"""Hostile input, each hole closed at its mechanism (docs/cli-contract.md): the one path check
(routetool.files.path_kind)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import routetool
from routetool.cli import main
from routetool.errors import RouteToolError
from routetool.files import check_output_paths, path_kind

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
