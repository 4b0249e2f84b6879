"""Answer first: at 80 columns the default reports fit one screen, whatever the number of layers."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from routetool.cli import main

ROOT = Path(__file__).resolve().parents[2]
CORRECT = str(ROOT / "tests" / "mutants.py") + ":correct"  # the reference as a kernel: fast on the CPU


def _lines(*args) -> tuple[int, str]:
    res = CliRunner(env={"COLUMNS": "80"}).invoke(main, [str(a) for a in args] + ["--no-progress"])
    assert res.exit_code in (0, 1), res.output
    return len(res.output.rstrip("\n").splitlines()), res.output


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("length")
    out = {}
    for layers in (4, 61):
        out[layers] = tmp / f"l{layers}.safetensors"
        res = CliRunner().invoke(main, ["synth", "--layers", str(layers), "--experts", "32", "--topk", "4",
                                        "--prefill", "24", "--decode-steps", "3", "--max-decode-batch", "4", "--padding", "fraction:0.2",
                                        "-o", str(out[layers]), "--no-progress"])
        assert res.exit_code == 0, res.output
    return out


def test_replay_of_a_bundled_trace_fits_40_lines():
    n, text = _lines("replay", ROOT / "traces" / "musespark1x-synth-bf16.safetensors", "--device", "cpu",
                     "--kernel", CORRECT)
    assert n <= 40, text
    assert text.index("PASS") < text.index("Comparisons")  # the verdict comes first


@pytest.mark.parametrize("command", [
    ["replay", "--device", "cpu", "--kernel", CORRECT],
    ["balance", "--device", "cpu", "--kernel", CORRECT, "--ep-size", "4"],
])
def test_61_layers_take_no_more_lines_than_4(traces, command):
    name, *options = command
    n4, _ = _lines(name, traces[4], *options)
    n61, text = _lines(name, traces[61], *options)
    assert n61 <= n4 + 1, text  # + 1: a wider layer number may wrap one line
    assert n61 <= 60, text


def test_failing_layers_get_a_line_each_at_most(traces):
    # a kernel that ignores padding fails every layer: they are named in one line, not a table each
    n4, _ = _lines("replay", traces[4], "--device", "cpu", "--kernel", CORRECT)
    n, text = _lines("replay", traces[61], "--device", "cpu", "--kernel", str(ROOT / "tests" / "mutants.py")
                     + ":padding_ignored")
    assert "bad_padding" in text.split("Comparisons")[1]  # the reason behind 'invalid', in the terminal
    assert n <= 60, text


def test_no_label_wraps_onto_a_line_of_its_own_at_80_columns(tmp_path):
    # replay's failing comparison ("kernel/recorded FAIL" put FAIL on a line of its own), info's
    # table titles ("Step shapes (8" / "distinct, same in" / "every layer)") and synth's captions
    # wrapped to their table's width
    _, replay = _lines("replay", ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors", "--no-latency", "--kernel",
                       str(ROOT / "tests" / "mutants.py") + ":biased_weights")
    assert "kernel/recorded ✗  1,296" in replay
    _, info = _lines("info", ROOT / "traces" / "musespark1x-synth-bf16.safetensors")
    assert "\nStep shapes (8 distinct, same in every layer)" in info
    _, synth = _lines("synth", "-o", tmp_path / "s.safetensors", "--layers", "2", "--experts", "16", "--topk", "2",
                      "--prefill", "40", "--decode-steps", "3")
    assert "realised statistics per layer" in synth
    assert "\nties@k: unpadded rows with an exact tie at the k-th boundary" in synth
    for out in (replay, info, synth):
        lines = [x.strip() for x in out.splitlines()]
        assert not [x for x in lines if x in ("FAIL", "layer", "boundary")], out
