"""Recorded outputs of replay, validate and balance, to hold every later version to.

Each case is one command line over the bundled traces or small deterministic synth traces (ties,
padding, non-finite rows, an ids-only import) with a known kernel; its exit code and its ``--json``
document, with timings and paths taken out (:func:`normalized`), are stored in
``tests/data/golden/<case>.json``. ``tests/report/test_golden.py`` runs every case and compares.

Record (only when a change of output is intended, and say why in the commit)::

    python tests/golden.py record
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GOLDEN = HERE / "data" / "golden"
MUTANTS = str(HERE / "mutants.py")

# inputs made once per run, into a temporary folder: name -> command line (routetool arguments)
SYNTH = {
    # bf16, sigmoid, fitted bias, CUDA-graph padding, exact ties and NaN/inf rows, prefill and decode steps
    "ties.safetensors": ["synth", "--layers", "2", "--experts", "64", "--topk", "6", "--prefill", "96,40",
                         "--decode-steps", "12", "--max-decode-batch", "8", "--ties", "6", "--nonfinite", "3",
                         "--bias", "fitted", "--seed", "3"],
    # fp32, softmax, route scale 1, fraction padding, eps, interleaved steps
    "softmax.safetensors": ["synth", "--layers", "2", "--experts", "20", "--topk", "4", "--normalization", "softmax",
                            "--route-scale", "1.0", "--eps", "1e-6", "--dtype", "float32", "--prefill", "50",
                            "--decode-steps", "9", "--max-decode-batch", "6", "--padding", "fraction:0.1",
                            "--order", "interleaved", "--ties", "3", "--seed", "5"],
}
DUMP = "ids.jsonl"  # a small routing dump, imported into an ids-only trace


def _dump_text() -> str:
    rows = []
    for step in range(6):
        for tok in range(3 + step % 3):
            ids = [(tok * 3 + step) % 16, (tok * 5 + step * 7 + 1) % 16]
            if ids[0] == ids[1]:
                ids[1] = (ids[1] + 1) % 16
            rows.append(json.dumps({"layer": step % 2, "step": step // 2, "topk_ids": ids}))
    return "\n".join(rows) + "\n"


BUNDLED = str(ROOT / "traces" / "musespark1x-synth-bf16.safetensors")
DEEPSEEK = str(ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors")

# case name -> (command line with {tmp}/{json} placeholders, whether it writes --json)
CASES = {
    "replay-bundled": ["replay", BUNDLED, "--no-latency"],
    "replay-deepseek": ["replay", DEEPSEEK, "--no-latency"],
    "replay-ties": ["replay", "{tmp}/ties.safetensors", "--no-latency"],
    "replay-softmax": ["replay", "{tmp}/softmax.safetensors", "--no-latency"],
    "replay-ties-padding-ignored": ["replay", "{tmp}/ties.safetensors", "--no-latency", "--kernel",
                                    MUTANTS + ":padding_ignored"],
    "replay-ties-biased-weights": ["replay", "{tmp}/ties.safetensors", "--no-latency", "--kernel",
                                   MUTANTS + ":biased_weights"],
    "replay-ids-only": ["replay", "{tmp}/ids.safetensors", "--no-latency"],
    "validate-ties": ["validate", "{tmp}/ties.safetensors", "{tmp}/softmax.safetensors", "--suite", "none"],
    "validate-ties-padding-ignored": ["validate", "{tmp}/ties.safetensors", "--suite", "none", "--kernel",
                                      MUTANTS + ":padding_ignored"],
    "validate-ids-only": ["validate", "{tmp}/ids.safetensors", "--suite", "none"],
    "balance-bundled-reference": ["balance", BUNDLED, "--reference", "--ep-size", "4,8"],
    "balance-ties-kernel": ["balance", "{tmp}/ties.safetensors", "--ep-size", "4", "--windows", "3", "--kernel",
                            "tiled"],
    "balance-softmax-reference": ["balance", "{tmp}/softmax.safetensors", "--reference", "--ep-size", "2"],
    "balance-ids-only": ["balance", "{tmp}/ids.safetensors", "--ep-size", "2"],
    "balance-dump": ["balance", "{tmp}/ids.jsonl", "--ep-size", "4"],
}

_DROP = {"elapsed_s", "duration_s", "rows_per_s", "wall_s"}


def normalized(doc, tmp: str):
    """``doc`` with timings dropped and the temporary folder and repository written as placeholders."""
    if isinstance(doc, dict):
        return {k: normalized(v, tmp) for k, v in doc.items() if k not in _DROP}
    if isinstance(doc, list):
        return [normalized(v, tmp) for v in doc]
    if isinstance(doc, str):
        return doc.replace(tmp, "{tmp}").replace(str(ROOT), "{root}")
    return doc


def make_inputs(tmp: str) -> None:
    """Write the synth traces, the dump and its ids-only import into ``tmp``."""
    from click.testing import CliRunner

    from routetool.cli import main

    runner = CliRunner()
    for name, args in SYNTH.items():
        res = runner.invoke(main, [*args, "-o", os.path.join(tmp, name), "--no-progress"])
        assert res.exit_code == 0, res.output
    Path(tmp, DUMP).write_text(_dump_text())
    res = runner.invoke(main, ["import", os.path.join(tmp, DUMP), "-o", os.path.join(tmp, "ids.safetensors"),
                               "--num-experts", "16"])
    assert res.exit_code == 0, res.output


def run_case(name: str, tmp: str) -> dict:
    """Run one case in-process; ``{"exit_code": ..., "json": normalized document}``."""
    from click.testing import CliRunner

    from routetool.cli import main

    out = os.path.join(tmp, f"{name}.json")
    if os.path.exists(out):
        os.remove(out)
    args = [a.format(tmp=tmp) for a in CASES[name]] + ["--json", out, "--no-progress"]
    if CASES[name][0] in ("replay", "validate", "balance"):
        args += ["--device", "cpu"]
    res = CliRunner().invoke(main, args)
    doc = json.loads(Path(out).read_text()) if os.path.exists(out) else None
    return {"exit_code": res.exit_code, "json": normalized(doc, tmp)}


def record() -> None:
    import tempfile

    os.environ["TRITON_INTERPRET"] = "1"
    GOLDEN.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        make_inputs(tmp)
        for name in CASES:
            got = run_case(name, tmp)
            (GOLDEN / f"{name}.json").write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
            print(name, got["exit_code"])


if __name__ == "__main__":
    if sys.argv[1:] != ["record"]:
        sys.exit("usage: python tests/golden.py record")
    sys.path.insert(0, str(ROOT))
    record()
