"""One kernel-under-test contract (routetool.engine.contract): a misbehaving kernel of each kind
gets the same failure class and the same exit code from replay, validate, balance and bench."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from routetool.cli import main
from routetool.engine.contract import CONTRACT_CLASSES, call_kernel
from routetool.io.trace import LayerArrays, RouterConfig

KERNELS = '''
import sys
import torch
from routetool_kernels.reference import musespark1x_routing_reference as ref


def _ref(g, b, *a, topk_weights=None, topk_ids=None, **k):
    return ref(g, b, *a, **k)


def crash(*a, **k):
    raise RuntimeError("illegal memory access")


def exits(*a, **k):
    sys.exit(3)


def scribble(g, b, *a, **k):
    out = _ref(g, b, *a, **k)
    g[0, 0] = float("nan")
    return out


def short(g, b, *a, **k):
    w, i = _ref(g, b, *a, **k)
    return w[1:], i[1:]


def float64_weights(g, b, *a, **k):
    w, i = _ref(g, b, *a, **k)
    return w.double(), i


def on_meta(g, b, *a, **k):
    w, i = _ref(g, b, *a, **k)
    return w.to("meta"), i.to("meta")


def rejects(*a, **k):
    """A routing kernel."""
    raise ValueError("not today")


def rejects_bf16(*a, **k):
    """A routing kernel; bfloat16 logits are not supported."""
    raise ValueError("bfloat16 is not supported")


def out_of_range(g, b, *a, **k):
    w, i = _ref(g, b, *a, **k)
    return w, i + 1000
'''

# kernel -> (failure class, exit code of the trace commands, exit code of bench)
EXPECTED = {
    "crash": ("crash", 1, 1),
    "exits": ("crash", 1, 1),
    "scribble": ("modified_input", 1, 1),
    "short": ("wrong_shape", 1, 1),
    "float64_weights": ("wrong_dtype", 1, 1),
    "on_meta": ("wrong_device", 1, 1),
    "rejects": ("rejected_undocumented", 1, 1),
    # documented: bad usage for a trace the user gave (exit 2); a shape bench made itself is 'rejected'
    "rejects_bf16": ("rejected_documented", 2, 0),
    "out_of_range": ("invalid:id_out_of_range", 1, 1),
}


@pytest.fixture
def setup(tmp_path, make_trace):
    """A folder of ``kernels.py`` (the kernels above) and ``t.safetensors`` (12 rows of bf16 logits, 2 steps)."""
    (tmp_path / "kernels.py").write_text(KERNELS)
    g = torch.randn(12, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    make_trace("t.safetensors", {0: LayerArrays(gating_output=g, step_offsets=torch.tensor([0, 5, 12]))},
               router=RouterConfig(num_experts=8, topk=2, route_scale=1.0))
    return tmp_path


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_command_judges_a_kernel_alike(setup, name):
    cls, code, bench_code = EXPECTED[name]
    trace, kernel = setup / "t.safetensors", f"{setup / 'kernels.py'}:{name}"
    replay = _run("replay", trace, "--kernel", kernel, "--no-latency", "--no-progress", "--device", "cpu")
    balance = _run("balance", trace, "--kernel", kernel, "--no-progress", "--device", "cpu", "--ep-size", "2")
    out = setup / f"{name}.json"
    validate = _run("validate", trace, "--suite", "none", "--kernel", kernel, "--no-progress", "--device", "cpu",
                    "--json", out, "--force")
    assert (replay.exit_code, balance.exit_code, validate.exit_code) == (code, code, code), \
        (replay.output, balance.output, validate.output)
    doc = json.loads(out.read_text())
    assert doc["exit_code"] == code and doc["verdict"] == "fail"
    assert [c["failure_classes"] for c in doc["cases"]] == [[cls]]
    for res in (replay, balance, validate):
        assert "Traceback" not in res.output
    if cls in CONTRACT_CLASSES:  # a broken call stops replay and balance with one line
        for res in (replay, balance):
            assert res.output.startswith("routetool: error:") and len(res.output.strip().splitlines()) == 1
    from routetool.analysis.bench import judge_kernel_call
    from routetool.analysis.suite import CaseInput
    from routetool.engine.execution import load_kernel

    _, fn = load_kernel(kernel)
    inp = CaseInput.of(g_bf16(), torch.zeros(8), 2, route_scale=1.0)
    status, bench_exit = judge_kernel_call(fn, inp, tie_ulps=16.0)
    assert bench_exit == bench_code, status
    assert status.startswith("rejected" if bench_code == 0 else "failed")
    assert cls in status


def g_bf16():
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1)).bfloat16()


def test_a_kept_contract_returns_the_outputs():
    g = g_bf16()
    from routetool_kernels.reference import musespark1x_routing_reference

    def fn(g, b, *a, topk_weights=None, topk_ids=None, **k):
        return musespark1x_routing_reference(g, b, *a, **k)

    out = call_kernel(fn, g, torch.zeros(8), params=dict(topk=2, route_scale=1.0))
    assert out.ok and out.exit_code == 0 and out.weights.shape == out.ids.shape == (6, 2)
