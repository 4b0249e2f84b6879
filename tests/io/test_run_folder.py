"""A run folder (one trace per rank) as one input of replay, validate, balance and info, and the
same commands under torchrun (gloo, 2 processes on the CPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from routetool.cli import main
from routetool.io.trace import LayerArrays, RouterConfig

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
ROOT = Path(__file__).resolve().parents[2]
MUTANTS = str(Path(__file__).resolve().parents[1] / "mutants.py")


def _run(*args):
    return CliRunner().invoke(main, [*map(str, args)], catch_exceptions=False)


def _json(*args) -> dict:
    res = _run(*args, "--json", "-")
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """Two data-parallel ranks of 2 layers, 64 experts, bf16, padded decode steps."""
    out = tmp_path_factory.mktemp("run") / "RUN"
    res = _run("synth", "-o", out, "--ranks", "2", "--layers", "2", "--experts", "64", "--topk", "4",
               "--prefill", "48", "--decode-steps", "5", "--max-decode-batch", "8", "--seed", "7", "--no-progress")
    assert res.exit_code == 0, res.output
    return out


def _rank_trace(run: Path, r: int) -> Path:
    return run / f"rank-{r}" / "trace.safetensors"


def test_synth_ranks_writes_a_run_folder_that_info_lists(run_dir):
    assert sorted(p.name for p in run_dir.iterdir()) == ["rank-0", "rank-1"]
    doc = _json("info", run_dir)
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert doc["ranks"][1]["layout"] == {"rank": 1, "world_size": 2, "dp_rank": 1, "dp_size": 2}
    assert doc["ranks"][0]["trace"].endswith("rank-0/trace.safetensors")
    res = _run("info", run_dir)
    assert res.exit_code == 0 and "rank-1" in res.output and "Per rank" in res.output, res.output


def test_replay_of_a_run_is_the_sum_of_its_ranks(run_dir):
    whole = _json("replay", run_dir, "--device", DEVICE, "--no-latency", "--no-progress")
    alone = [_json("replay", _rank_trace(run_dir, r), "--device", DEVICE, "--no-latency", "--no-progress")
             for r in (0, 1)]
    k = whole["totals"]["kernel_vs_reference"]
    for key in ("rows", "exact", "mismatch", "invalid", "padded"):
        assert k[key] == sum(a["totals"]["kernel_vs_reference"][key] for a in alone), key
    assert whole["load_all_layers"]["expert_counts_tokens"] == [
        x + y for x, y in zip(*(a["load_all_layers"]["expert_counts_tokens"] for a in alone))]
    for layer, a0, a1 in zip(whole["layers"], alone[0]["layers"], alone[1]["layers"]):
        assert layer["num_tokens"] == a0["num_tokens"] + a1["num_tokens"]
        assert layer["padded_rows"] == a0["padded_rows"] + a1["padded_rows"]
    assert [r["rank"] for r in whole["ranks"]] == [0, 1]
    assert [r["num_tokens"] for r in whole["ranks"]] == [sum(x["num_tokens"] for x in a["layers"]) for a in alone]
    assert whole["world_size"] == 1 and whole["verdict"] == "pass"
    assert alone[0]["ranks"] is None


def test_a_failing_rank_is_named_in_the_terminal_and_the_json(run_dir):
    res = _run("replay", run_dir, "--device", DEVICE, "--no-latency", "--no-progress",
               "--kernel", f"{MUTANTS}:padding_ignored")
    assert res.exit_code == 1, res.output
    assert "failing ranks (2 of 2): rank-0" in res.output, res.output
    assert "rank-0 layer 0 step" in res.output, res.output  # a failing row says where, rank first
    doc = _json("replay", run_dir, "--device", DEVICE, "--no-latency", "--no-progress",
                "--kernel", f"{MUTANTS}:padding_ignored")
    assert doc["totals"]["kernel_vs_reference"]["failures"][0]["rank"] == 0
    assert [r["ok"] for r in doc["ranks"]] == [False, False]


def test_validate_takes_a_run_folder_as_one_family_per_rank(run_dir):
    doc = _json("validate", run_dir, "--suite", "none", "--device", DEVICE, "--no-progress")
    assert [c["name"] for c in doc["cases"]] == [f"trace:RUN/rank-{r}/layer{x}" for r in (0, 1) for x in (0, 1)]
    assert doc["verdict"] == "pass" and doc["world_size"] == 1


def _balance(path, *extra) -> dict:
    return _json("balance", path, "--device", DEVICE, "--no-progress", "--reference", "--ep-size", "4", *extra)


def test_balance_adds_the_data_parallel_ranks_loads(run_dir):
    whole = _balance(run_dir)
    alone = [_balance(_rank_trace(run_dir, r)) for r in (0, 1)]
    assert whole["all_layers"]["expert_counts_assignments"] == [
        x + y for x, y in zip(*(a["all_layers"]["expert_counts_assignments"] for a in alone))]
    for layer, a0, a1 in zip(whole["layers"], alone[0]["layers"], alone[1]["layers"]):
        assert layer["assignments"] == a0["assignments"] + a1["assignments"]
        assert layer["num_steps"] == max(a0["num_steps"], a1["num_steps"])  # step s of both ranks is one global step
    assert [r["rank"] for r in whole["ranks"]] == [0, 1]
    assert [r["assignments"] for r in whole["ranks"]] == [sum(x["assignments"] for x in a["layers"]) for a in alone]
    assert sum(r["share"] for r in whole["ranks"]) == pytest.approx(1.0)
    res = _run("balance", run_dir, "--device", DEVICE, "--no-progress", "--reference", "--ep-size", "4")
    assert res.exit_code == 0 and "ranks (2 summed)" in res.output, res.output


def test_tensor_parallel_peers_are_counted_once_and_dp_ranks_step_by_step(run_dir, tmp_path, copy_trace):
    # ranks 0, 1: DP rank 0 (TP peers, the same tokens); ranks 2, 3: DP rank 1
    run = tmp_path / "TP"  # the run's rank-0 trace written again as each rank, with its layout metadata
    for r in range(4):
        copy_trace(_rank_trace(run_dir, 0), _rank_trace(run, r), drop=("rank", "world_size", "dp_rank", "dp_size"),
                   rank=str(r), world_size="4", dp_rank=str(r // 2), tp_rank=str(r % 2))
    one = _balance(_rank_trace(run_dir, 0))
    whole = _balance(run)
    assert whole["all_layers"]["expert_counts_assignments"] == [2 * c for c in one["all_layers"]["expert_counts_assignments"]]
    assert [r["rank"] for r in whole["ranks"]] == [0, 2]
    assert any("rank-1, rank-3 route the same tokens" in n for n in whole["notes"]), whole["notes"]
    # two identical DP ranks: every global step is twice one rank's step, so every share-based figure is the same
    for a, b in zip(whole["layers"], one["layers"]):
        assert a["num_steps"] == b["num_steps"]
        assert a["ranks"][0]["step_balancedness"] == b["ranks"][0]["step_balancedness"]


def test_run_folder_errors_are_one_line(run_dir, tmp_path, make_trace):
    empty = tmp_path / "empty"
    empty.mkdir()
    res = _run("replay", empty, "--no-progress")
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "without rank-<r>/ traces" in res.output

    two = tmp_path / "two"
    shutil.copytree(run_dir, two)
    shutil.copy(_rank_trace(run_dir, 1), two / "rank-0" / "other.safetensors")
    res = _run("replay", two, "--no-progress")
    assert res.exit_code == 2 and "rank-0: holds 2 .safetensors files" in res.output, res.output

    moved = tmp_path / "moved"
    (moved / "rank-0").mkdir(parents=True)
    shutil.copy(_rank_trace(run_dir, 1), moved / "rank-0" / "trace.safetensors")
    res = _run("balance", moved, "--no-progress")
    assert res.exit_code == 2 and "holds the trace of rank 1, not of rank 0" in res.output, res.output

    mixed = tmp_path / "mixed"
    shutil.copytree(run_dir, mixed)
    layer = LayerArrays(gating_output=torch.zeros(3, 16), bias=torch.zeros(16), step_offsets=torch.tensor([0, 3]))
    make_trace(_rank_trace(mixed, 1), {0: layer}, RouterConfig(num_experts=16, topk=2))
    for command in ("replay", "validate", "balance", "info"):
        res = _run(command, mixed, "--no-progress") if command != "validate" else \
            _run(command, mixed, "--suite", "none", "--no-progress")
        assert res.exit_code == 2 and res.output.count("\n") == 1, (command, res.output)
        assert "rank-1 routes with num_experts 16, rank-0 with 64" in res.output, (command, res.output)


@pytest.mark.parametrize("command", ["replay", "balance", "info"])
def test_a_rank_folder_given_alone_names_its_trace_and_its_run(run_dir, command):
    res = _run(command, run_dir / "rank-1")
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert (f"name the trace itself, {run_dir / 'rank-1' / 'trace.safetensors'}, or the run folder {run_dir} for "
            "every rank") in res.output, res.output


def test_synth_ranks_share_one_model_and_see_different_tokens(tmp_path):
    from safetensors import safe_open

    out = tmp_path / "RUN"
    res = _run("synth", "-o", out, "--ranks", "2", "--layers", "1", "--experts", "32", "--topk", "4", "--prefill", "512",
               "--decode-steps", "2", "--bias", "fitted", "--fit-steps", "5", "--no-progress")
    assert res.exit_code == 0, res.output
    with safe_open(str(_rank_trace(out, 0)), "pt") as a, safe_open(str(_rank_trace(out, 1)), "pt") as b:
        assert torch.equal(a.get_tensor("layers.0.bias"), b.get_tensor("layers.0.bias"))  # one model
        assert a.get_tensor("layers.0.bias").abs().sum() > 0
        ga, gb = a.get_tensor("layers.0.gating_output"), b.get_tensor("layers.0.gating_output")
        assert not torch.equal(ga[:64], gb[:64])  # different tokens
        # the same experts are hot on both ranks: their mean logits per expert agree closely
        assert torch.corrcoef(torch.stack([ga.float().mean(0), gb.float().mean(0)]))[0, 1] > 0.9


def test_outputs_never_replace_a_ranks_trace(run_dir):
    target = _rank_trace(run_dir, 1)
    before = target.read_bytes()
    res = _run("replay", run_dir, "--no-progress", "--json", target, "--force")
    assert res.exit_code == 2 and "input" in res.output, res.output
    assert target.read_bytes() == before


# --------------------------------------------------------------------------------------- torchrun
def _torchrun(*args, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1" if DEVICE == "cpu" else os.environ.get("TRITON_INTERPRET", "0"),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), "-m", "routetool", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=600)


def _same(a: dict, b: dict, drop=("world_size", "elapsed_s", "rows_per_s", "duration_s")):
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k not in drop}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x
    return clean(a) == clean(b)


@pytest.mark.parametrize("command", [
    ["replay", "RUN", "--no-latency"],
    ["validate", "RUN", "--suite", "none"],
    ["balance", "RUN", "--reference", "--ep-size", "4"],
])
def test_torchrun_two_processes_equal_one(run_dir, tmp_path, command):
    args = [run_dir if a == "RUN" else a for a in command] + ["--device", DEVICE, "--no-progress"]
    single = _json(*args)
    proc = _torchrun(*args, "--json", tmp_path / "two.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world_size"] == 2 and single["world_size"] == 1
    assert _same(single, two)
    assert proc.stdout.count("routetool ") == 1, proc.stdout  # one report (the first process's)


def test_torchrun_findings_and_errors_are_reported_once(run_dir, tmp_path):
    proc = _torchrun("replay", run_dir, "--device", DEVICE, "--no-progress", "--no-latency",
                     "--kernel", f"{MUTANTS}:padding_ignored")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.count("failing ranks (2 of 2)") == 1, proc.stdout

    # a kernel that crashes on the second process only: the first process reports it, once
    kernel = tmp_path / "second_crashes.py"
    kernel.write_text("import os\nfrom tests.mutants import correct\n\n\n"
                      "def route(*args, **kwargs):\n"
                      "    if os.environ.get('RANK') == '1':\n"
                      "        raise RuntimeError('boom on process 1')\n"
                      "    return correct(*args, **kwargs)\n")
    proc = _torchrun("replay", run_dir, "--device", DEVICE, "--no-progress", "--no-latency", "--kernel",
                     f"{kernel}:route")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("routetool: error:")]
    assert len(errors) == 1 and "boom on process 1" in errors[0], proc.stderr

    proc = _torchrun("replay", run_dir / "nothing.safetensors", "--no-progress")
    assert proc.returncode != 0
    assert proc.stderr.count("routetool: error:") == 1, proc.stderr


# --------------------------------------------------------------------------------------- hostile run folders
def test_outputs_never_go_into_a_rank_folder(run_dir, tmp_path):
    before = sorted(p.name for p in (run_dir / "rank-1").iterdir())
    for args in (["replay", run_dir, "--json", run_dir / "rank-1" / "new.json"],
                 ["balance", run_dir, "--eplb-out", run_dir / "rank-1" / "eplb.json"],
                 ["validate", run_dir, "--suite", "none", "--junit", run_dir / "rank-1" / "r.safetensors"]):
        res = _run(*args, "--no-progress", "--device", DEVICE)
        assert res.exit_code == 2 and "is in a rank folder of this run's input" in res.output, res.output
    assert sorted(p.name for p in (run_dir / "rank-1").iterdir()) == before
    res = _run("replay", run_dir, "--json", run_dir / "rank-1", "--no-progress")
    assert res.exit_code == 2 and "is a directory" in res.output, res.output


def test_a_file_read_by_two_ranks_or_two_inputs_is_refused(run_dir, tmp_path):
    linked = tmp_path / "linked"
    (linked / "rank-0").mkdir(parents=True)
    shutil.copy(ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors", linked / "rank-0" / "trace.safetensors")
    (linked / "rank-1").symlink_to(linked / "rank-0")  # the same file twice (a trace without rank metadata)
    res = _run("balance", linked, "--no-progress")
    assert res.exit_code == 2 and "is read by rank-1 and by rank-0" in res.output, res.output
    res = _run("validate", run_dir, _rank_trace(run_dir, 0), "--suite", "none", "--no-progress", "--device", DEVICE)
    assert res.exit_code == 2 and "its steps would be counted twice" in res.output, res.output


@pytest.mark.parametrize("meta, message", [
    ({"rank": "x1"}, "the metadata rank='x1' is not a plain non-negative integer"),
    ({"rank": "1", "world_size": "1"}, "says rank 1 of a world_size of 1"),
])
def test_layout_metadata_that_contradicts_itself_is_refused(run_dir, tmp_path, meta, message, copy_trace):
    bad = tmp_path / "bad"
    shutil.copytree(run_dir, bad)
    copy_trace(_rank_trace(run_dir, 1), _rank_trace(bad, 1), **meta)
    res = _run("info", bad)
    assert res.exit_code == 2 and message in res.output and res.output.count("\n") == 1, res.output


def test_tensor_parallel_peers_holding_different_steps_are_refused(run_dir, tmp_path, copy_trace):
    peers = tmp_path / "peers"
    copy_trace(_rank_trace(run_dir, 0), _rank_trace(peers, 0), dp_rank="0", rank="0")
    copy_trace(_rank_trace(run_dir, 1), _rank_trace(peers, 1), dp_rank="0", rank="1")
    res = _run("balance", peers, "--no-progress", "--reference")
    assert res.exit_code == 2 and "share dp_rank 0" in res.output and "hold different steps" in res.output, res.output


def test_ids_only_ranks_are_nothing_checked_not_pass(tmp_path):
    dump = tmp_path / "ids.jsonl"
    dump.write_text("".join(json.dumps({"layer": 0, "step": s, "topk_ids": [s % 4, (s + 1) % 4]}) + "\n"
                            for s in range(6)))
    run = tmp_path / "IDS"
    for r in (0, 1):
        (run / f"rank-{r}").mkdir(parents=True)
        res = _run("import", dump, "-o", run / f"rank-{r}" / "trace.safetensors", "--num-experts", "4", "--topk", "2")
        assert res.exit_code == 0, res.output
    # (the two imports are the same bytes in two files: allowed, they are two ranks' recordings)
    res = _run("replay", run, "--no-progress", "--no-latency", "--device", DEVICE)
    assert res.exit_code == 0 and "NOTHING CHECKED" in res.output and "ranks: all 2 nothing checked" in res.output, \
        res.output


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replay_without_a_launcher(run_dir, join_timeout: str) -> subprocess.CompletedProcess:
    """replay with torchrun's variables set (world of 2) but no other process."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "ROUTETOOL_JOIN_TIMEOUT_S": join_timeout, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "routetool", "replay", str(run_dir), "--device", "cpu",
                           "--no-progress"], capture_output=True, text=True, env=env, timeout=120)


def test_launcher_variables_without_a_launcher_end_in_one_line_not_a_hang(run_dir):
    proc = _replay_without_a_launcher(run_dir, "2")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "did not join within 2 s" in proc.stderr, proc.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "1e309", "2_0", "-1", "0", "1e6", "\n2"])
def test_a_bad_join_timeout_is_one_line_not_a_wait(monkeypatch, value):
    # each of these waited forever (nan, inf, 1e309 compare false with the clock) or read 2_0 as 20
    from routetool.engine.distributed import join_timeout
    from routetool.errors import RouteToolError

    monkeypatch.setenv("ROUTETOOL_JOIN_TIMEOUT_S", value)
    with pytest.raises(RouteToolError, match="ROUTETOOL_JOIN_TIMEOUT_S=.* is not a number of seconds") as info:
        join_timeout(RouteToolError)
    assert "\n" not in str(info.value)
    monkeypatch.setenv("ROUTETOOL_JOIN_TIMEOUT_S", "2.5")
    assert join_timeout(RouteToolError) == 2.5


def test_a_bad_join_timeout_under_a_launcher_exits_2(run_dir):
    proc = _replay_without_a_launcher(run_dir, "nan")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "ROUTETOOL_JOIN_TIMEOUT_S='nan'" in proc.stderr, proc.stderr


def test_torchrun_help_is_printed_once():
    proc = _torchrun("replay", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Usage: ") == 1, proc.stdout


@pytest.mark.parametrize("other", ["rank-0/notes.txt", "rank-1/report.json", "rank-0/sub/trace.safetensors"])
def test_synth_ranks_force_keeps_a_file_inside_a_rank_folder(tmp_path, other):
    # --force replaced the run folder whole when its top level held only rank-<r> folders: a file
    # inside one (notes, a report written there) was removed with it
    out = tmp_path / "run"
    args = ["synth", "-o", str(out), "--ranks", "2", "--layers", "1", "--experts", "8", "--topk", "2", "--prefill", "8",
            "--decode-steps", "1", "--no-progress"]
    assert CliRunner().invoke(main, args).exit_code == 0
    (out / other).parent.mkdir(parents=True, exist_ok=True)
    (out / other).write_text("keep")
    res = CliRunner().invoke(main, [*args, "--force"])
    assert res.exit_code == 2, res.output
    assert "is no trace file" in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert (out / other).read_text() == "keep"
    (out / other).unlink()
    if (out / other).parent.name == "sub":
        (out / other).parent.rmdir()
    assert CliRunner().invoke(main, [*args, "--force"]).exit_code == 0  # (its trace files only: replaced)
