"""Numbers on the command line: options of one number are click's own types (ranges, finite
values); the items of lists and mini-languages (``--layers``, ``--ep-size``, ``--skew``,
``--padding fraction:F``, ``--affinity``) are read strictly by routetool.numtext.

Python's int()/float() accept digits of other scripts (Arabic-Indic "١", fullwidth "１"),
underscores ("1_0") and surrounding whitespace (" 1"): the lists refuse them (an item with
spaces around it was read as another list than the one written).
"""

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from routetool.cli import main
from routetool.errors import RouteToolError
from routetool.numtext import list_items, number_problem
from tests.helpers import command_params

TINY = Path(__file__).resolve().parents[2] / "traces" / "deepseek-v3-hf-tiny.safetensors"

ARABIC_ONE = "\u0661"  # ١


def _numeric_options():
    """(command path, option) for every option of every command whose type is a click number type."""
    return command_params(main, lambda p: isinstance(p, click.Option)
                          and isinstance(p.type, click.types._NumberParamTypeBase))


def test_every_numeric_option_is_found():
    # the walk sees the commands the trial used (a typo in it would make the next tests vacuous)
    names = {f"{path} {param.opts[0]}" for path, param in _numeric_options()}
    for expected in ("routetool replay --tie-ulps", "routetool replay --layer", "routetool validate --tie-ulps",
                     "routetool bench --rep-ms", "routetool balance --windows", "routetool balance --layer",
                     "routetool import --skip-rows", "routetool synth --ties", "routetool synth --route-scale",
                     "routetool capture hf --batch", "routetool capture hf --router-std"):
        assert expected in names, expected


def test_numeric_options_are_clicks_own_types():
    # (routetool.cli.numbers wrapped them to refuse what int()/float() read beyond plain decimals)
    for path, param in _numeric_options():
        assert type(param.type).__module__ == "click.types", (path, param.opts, type(param.type))


@pytest.mark.parametrize("text, expected", [
    ("1", 1), ("+1", 1), ("007", 7),  # plain decimals
])
def test_plain_integers_are_read(text, expected):
    for path, param in _numeric_options():
        if getattr(param.type, "max", None) is not None and param.type.max < expected:
            continue  # (a fraction such as diff's --max-flip-rate: 7 is out of its range, not misread)
        assert param.type.convert(text, param, None) == expected, (path, param.opts)


@pytest.mark.parametrize("args, fragment", [
    # ranges and finite values: click's messages, one line, exit 2
    (["synth", "--ties", "100001"], "Invalid value for '--ties': 100001 is not in the range 0<=x<=100000."),
    (["bench", "--rep-ms", "inf"], "Invalid value for '--rep-ms': inf is not in the range 1<=x<=60000."),
    (["replay", "t.safetensors", "--tie-ulps", "nan"], "Invalid value for '--tie-ulps': must be a number, not nan"),
    (["validate", "--tie-ulps", "nan"], "Invalid value for '--tie-ulps': must be a number, not nan"),
    (["replay", "t.safetensors", "--layer", "1.5"], "Invalid value for '--layer': '1.5' is not a valid integer."),
    (["balance", "t.safetensors", "--windows", "0"], "Invalid value for '--windows': 0 is not in the range x>=1."),
    (["import", "d.jsonl", "-o", "o.safetensors", "--skip-rows", "-1"], "Invalid value for '--skip-rows'"),
    (["capture", "hf", "--arch", "mixtral", "--text", "t.txt", "-o", "o.safetensors", "--batch", "0"],
     "Invalid value for '--batch': 0 is not in the range 1<=x<=65536."),
    # the numbers inside mini-languages are plain decimals (routetool.numtext)
    (["synth", "--affinity", ARABIC_ONE], (f"--affinity '{ARABIC_ONE}' is not a plain decimal number: ASCII digits "
                                           "0-9 only, without spaces, underscores or other scripts' digits; write 1.0 "
                                           "(or auto)")),
    (["synth", "--skew", f"zipf:{ARABIC_ONE}"], f"--skew 'zipf:{ARABIC_ONE}': '{ARABIC_ONE}' is not a plain decimal"),
    (["synth", "--skew", "hot:8:1_0"], "--skew 'hot:8:1_0': '1_0' is not a plain decimal number"),
    (["synth", "--padding", "fraction: 0.1"], "--padding 'fraction: 0.1': ' 0.1' is not a plain decimal number"),
])
def test_bad_numbers_are_one_line_errors(tmp_path, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    if args[0] == "synth":
        args = [*args, "-o", "s.safetensors"]
    res = CliRunner().invoke(main, args, prog_name="routetool", catch_exceptions=False)
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("routetool: error: "), res.output
    assert fragment in lines[0]
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_number_problem():
    assert number_problem("2.5") == number_problem("12", integer=True) == ""
    assert number_problem("abc") == number_problem("1.5", integer=True) == ""  # no number at all: the caller's message
    assert number_problem("1_0", integer=True) == ("'1_0' is not a plain decimal integer: ASCII digits 0-9 only, "
                                                   "without spaces, underscores or other scripts' digits; write 10")
    assert number_problem(f"{ARABIC_ONE}.5").endswith("; write 1.5")
    assert number_problem(" inf").endswith("; write inf")


@pytest.mark.parametrize("args, fragment", [
    # list items were stripped: "0, 1" read as 0,1
    (["balance", str(TINY), "--ep-size", " 4"], "--ep-size ' 4': the item ' 4' has spaces around it (write the list "
                                                "without spaces: --ep-size 4)"),
    (["balance", str(TINY), "--capacity-factor", "1.0 ,2"], "--capacity-factor '1.0 ,2': the item '1.0 '"),
    (["balance", str(TINY), "--layers", "1,\t2"], "--layers '1,\\t2': the item '\\t2' has spaces around it"),
    (["replay", str(TINY), "--layers", "1, 2"], ("--layers '1, 2': the item ' 2' has spaces around it (write the list "
                                                 "without spaces: --layers 1,2)")),
    (["replay", str(TINY), "--layers", "1 -2"], "--layers '1 -2': cannot parse '1 -2'"),  # inside a range too
    (["synth", "-o", "z.safetensors", "--prefill", " 8"], "--prefill ' 8': the item ' 8' has spaces around it"),
    (["bench", "--tokens", "1, 64"], "--tokens '1, 64': the item ' 64'"),
    (["bench", "--experts", "256 "], "--experts '256 ': the item '256 '"),
    (["bench", "--topk", " 8"], "--topk ' 8': the item ' 8'"),
    (["bench", "--dtype", "fp32, bf16"], "--dtype 'fp32, bf16': the item ' bf16' has spaces around it"),
])
def test_list_items_with_spaces_are_refused(tmp_path, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, [*args, "--no-progress"], prog_name="routetool", catch_exceptions=False)
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"routetool: error: {fragment}"), res.output
    assert list(tmp_path.iterdir()) == []


def test_list_items():
    assert list_items("--x", "8,16", "8,16") == ["8", "16"]
    for text in ("8,,16", "8,", ",8", "8, ,16"):
        with pytest.raises(RouteToolError, match="has an empty item"):
            list_items("--x", text, "8,16")
    with pytest.raises(RouteToolError, match=r"the item ' 16' has spaces around it \(write the list without spaces: "
                                             r"--x 8,16\)"):
        list_items("--x", "8, 16", "8,16")
