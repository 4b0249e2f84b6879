"""Fuzz the two-level kernel against the reference under the Triton interpreter (CPU).

Usage (repository root): python benchmarks/fuzz_two_level.py SEED SECONDS [OUT_DIR]
Random shapes (1-600 experts, topk up to 32), fp32/bf16/fp16 logits, ties (constant,
quantised, integer-like rows; zero, quantised or column-crowding bias), NaN/inf logits,
multiplier, eps, softmax, padding, and six two-level launches (1-4 tokens per tile, 1-4
warps, 16-64 columns). Each case is checked with the kernel tests' invariants and their
tie-aware comparison with the reference; a failing case is printed and saved to OUT_DIR.
"""
import os, sys, time, random, traceback
os.environ["TRITON_INTERPRET"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "tests"))
import torch
from kernel import fused_musespark1x_routing
from kernel.routing import LaunchConfig, padded_num_experts
from helpers import assert_routing_invariants
from test_kernel import _check_against_reference

seed0 = int(sys.argv[1]); budget = float(sys.argv[2])
out_dir = sys.argv[3] if len(sys.argv) > 3 else "."
rng = random.Random(seed0)
t0 = time.time(); n = 0; fails = 0
while time.time() - t0 < budget:
    n += 1
    E = rng.choice([1, 3, 8, 33, 60, 64, 72, 96, 128, 160, 200, 256, 257, 384, 512, 600])
    K = rng.randint(1, min(E, 32))
    T = rng.randint(1, 9)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    mode = rng.choice(["randn", "quant", "const", "crowd", "nonfinite"])
    x = torch.randn((T, E), generator=g) * rng.choice([0.5, 2, 8])
    if mode == "quant":
        x = torch.round(x * rng.choice([1, 2, 4])) / 2
    elif mode == "const":
        x[:] = rng.choice([0.0, 1.5, -3.0])
    elif mode == "nonfinite":
        m = torch.rand((T, E), generator=g)
        x[m < 0.05] = float("nan"); x[(m > 0.05) & (m < 0.08)] = float("-inf"); x[(m > 0.08) & (m < 0.09)] = float("inf")
    bmode = rng.choice(["randn", "zero", "quant", "col"])
    b = torch.randn(E, generator=g) * 0.1
    if bmode == "zero": b.zero_()
    elif bmode == "quant": b = torch.round(b * 20) / 20
    elif bmode == "col": b = torch.where(torch.arange(E) % rng.choice([32, 64]) == rng.randrange(8), 0.5, 0.0)
    if mode == "crowd":
        b = b + torch.where(torch.arange(E) % 32 == 3, 1.0, 0.0)
    x = x.to(dtype)
    norm = rng.choice(["sigmoid", "softmax"])
    mult = rng.choice([None, None, 0.7, -1.3])
    eps = rng.choice([None, None, 1e-3])
    pad = (torch.rand(T, generator=g) < 0.2) if rng.random() < 0.5 else None
    e_pad = padded_num_experts(E); k2 = 1 << (K - 1).bit_length()
    bt, nw, w = rng.choice([(1, 1, 32), (2, 1, 32), (4, 4, 32), (2, 2, 32), (1, 1, 64), (4, 1, 16)])
    W = max(min(w, e_pad), k2)
    cfg = LaunchConfig(block_t=bt, chunk=W, num_warps=nw, algorithm="two_level", programs_per_sm=0)
    kw = dict(router_output_multiplier=mult, router_score_normalization=norm, router_score_division_eps=eps)
    try:
        wts, ids = fused_musespark1x_routing(x, b, K, 2.5, is_padding=pad, config=cfg, **kw)
        assert_routing_invariants(wts, ids, E, K, 2.5, is_padding=pad, eps=eps)
        _check_against_reference(wts, ids, x, b, K, 2.5, 1e-5, is_padding=pad, **kw)
    except Exception as exc:
        fails += 1
        print(f"FAIL T={T} E={E} K={K} {dtype} mode={mode} bias={bmode} norm={norm} mult={mult} eps={eps} "
              f"pad={pad is not None} cfg={cfg}: {type(exc).__name__}: {str(exc)[:300]} | {traceback.format_exc().splitlines()[-3][:200]}", flush=True)
        torch.save(dict(x=x, b=b, K=K, pad=pad, kw=kw, cfg=cfg), os.path.join(out_dir, f"fuzz-case-{seed0}-{fails}.pt"))
print(f"seed {seed0}: {n} cases, {fails} failures", flush=True)
