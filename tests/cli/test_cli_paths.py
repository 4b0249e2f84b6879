"""An empty file or folder name is refused as such (routetool.cli.paths).

``Path("")`` is ``Path(".")``: `routetool balance ''` read the current folder and then said it
held no dump, `replay --json ''` said the current folder was a directory.
"""

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from routetool.cli import main
from routetool.cli.paths import EMPTY, PATH, PATH_TEXT, NonEmptyPath, NonEmptyText
from tests.helpers import command_params


def _path_params():
    """(command path, parameter) for every parameter that names a file or folder."""
    return command_params(main, lambda p: isinstance(p.type, click.Path) or getattr(p, "metavar", None) == "PATH")


def test_every_path_parameter_refuses_the_empty_name():
    found = _path_params()
    names = {f"{path} {param.name}" for path, param in found}
    for expected in ("routetool replay trace", "routetool replay json_path", "routetool validate traces",
                     "routetool validate junit_path", "routetool bench csv_path", "routetool bench trace_path",
                     "routetool balance source", "routetool balance eplb_out", "routetool import output",
                     "routetool synth out", "routetool info trace", "routetool capture hf model_path"):
        assert expected in names, expected
    for path, param in found:
        assert isinstance(param.type, (NonEmptyPath, NonEmptyText)), (path, param.name)
        with pytest.raises(click.BadParameter, match="an empty name is no path"):
            param.type.convert("", param, None)


def test_the_types_still_convert_names():
    assert str(PATH.convert("traces/x.safetensors", None, None)) == "traces/x.safetensors"
    assert PATH_TEXT.convert("-", None, None) == "-"


@pytest.mark.parametrize("args", [
    ["balance", ""], ["import", "", "-o", "out.safetensors"], ["replay", ""], ["info", ""], ["validate", ""],
    ["synth", "-o", ""], ["replay", "x.safetensors", "--json", ""], ["bench", "--csv", ""],
])
def test_an_empty_name_is_a_one_line_usage_error(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and EMPTY in lines[0], result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [
    ["replay", "TRACE", "--no-latency", "--no-progress", "--json", "OUT"],
    ["validate", "TRACE", "--suite", "none", "--no-progress", "--junit", "OUT"],
    ["balance", "TRACE", "--no-progress", "--json", "OUT"],
    ["balance", "TRACE", "--no-progress", "--eplb-out", "OUT"],
    ["info", "TRACE", "--json", "OUT"],
    ["synth", "-o", "OUT", "--experts", "8", "--topk", "2", "--prefill", "4", "--decode-steps", "0"],
    ["import", "DUMP", "-o", "OUT"],
])
def test_an_output_under_a_file_is_named_as_a_file(args, tmp_path):
    # was "notes.txt: folder does not exist (create it first)", for a folder that is a file
    trace = Path(__file__).resolve().parents[2] / "traces" / "deepseek-v3-hf-tiny.safetensors"
    dump = tmp_path / "d.jsonl"
    dump.write_text('{"topk_ids": [1, 2]}\n')
    blocker = tmp_path / "notes.txt"
    blocker.write_text("keep")
    swap = {"TRACE": str(trace), "DUMP": str(dump), "OUT": str(blocker / "sub" / "out.json")}
    result = CliRunner().invoke(main, [swap.get(a, a) for a in args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines == [f"routetool: error: {blocker}: is a file, not a folder (choose another output path)"], \
        result.output
    assert blocker.read_text() == "keep"
