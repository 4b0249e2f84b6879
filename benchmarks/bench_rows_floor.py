"""The floors under the rows kernel's large-batch launch: what its grid and its load pattern cost alone.

Times, with CUDA-graph medians, on one shape (default 65536 x 256 bf16, two threads a token, one-warp programs):

* ``empty``: a one-warp program that does nothing, on the rows launch's grid (the block launcher's floor);
* ``own-loads``: each thread reads its token's chunks as the rows kernel does (16 bytes a chunk, chunk
  ``i * LANES + lane`` in iteration ``i``, a row's threads adjacent), XORs them and stores a word a token: the
  kernel's memory traffic and pattern without its arithmetic (every load in flight at once: unrolled);
* ``coalesced``: the same bytes read as whole rows (each warp's loads contiguous), the pattern's alternative;
* ``rows``: the router itself (``fused_musespark1x_routing`` with that launch; it also starts each launch early
  with PDL, which the three others do not).

Usage (GPU machine, repository root; ``bash benchmarks/gpu.sh floor`` runs it with its defaults):
    python benchmarks/bench_rows_floor.py [--tokens 65536] [--experts 256] [--lanes 2] [--csv floor.csv]
"""

from __future__ import annotations

import argparse
import csv

import torch
import triton
import triton.language as tl
import triton.testing

from routetool_kernels import fused_musespark1x_routing
from routetool_kernels.routing_policy import LaunchConfig


@triton.jit
def _empty(out_ptr):
    """Nothing (a program the launcher places and retires)."""


@triton.jit
def _own_loads(x_ptr, out_ptr, num_tokens, stride_m, BLOCK_T: tl.constexpr, LANES: tl.constexpr,
               ITERS: tl.constexpr):
    """XOR of each row's int32 words (``x_ptr``: ``(T, 2 * stride_m)`` bf16 as words), read chunk by chunk as
    the rows kernel reads them; one word a row to ``out_ptr``."""
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    base = x_ptr + (tl.minimum(row, num_tokens - 1).to(tl.int64) * stride_m)[:, None, None]
    lane = tl.arange(0, LANES)[None, :, None]
    col = tl.arange(0, 4)[None, None, :]
    acc = tl.zeros([BLOCK_T, LANES, 4], tl.int32)
    for i in tl.static_range(ITERS):
        acc ^= tl.load(base + (i * LANES + lane) * 4 + col)
    tl.store(out_ptr + row, tl.xor_sum(tl.xor_sum(acc, 2), 1), mask=row < num_tokens)


@triton.jit
def _coalesced(x_ptr, out_ptr, num_tokens, stride_m, BLOCK_T: tl.constexpr, WORDS: tl.constexpr):
    """:func:`_own_loads`'s result from whole rows (``WORDS`` int32 words a row) loaded at once."""
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    base = x_ptr + (tl.minimum(row, num_tokens - 1).to(tl.int64) * stride_m)[:, None]
    x = tl.load(base + tl.arange(0, WORDS)[None, :])
    tl.store(out_ptr + row, tl.xor_sum(x, 1), mask=row < num_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--experts", type=int, default=256, help="a power of two, 8 x --lanes or more (default 256)")
    ap.add_argument("--lanes", type=int, default=2, help="threads a token of the rows launch (default 2)")
    ap.add_argument("--csv", default=None, help="also write the rows here (kernel, tokens, experts, lanes, us, GB/s)")
    a = ap.parse_args()
    T, E, lanes = a.tokens, a.experts, a.lanes
    if E & (E - 1) or lanes & (lanes - 1) or E < 8 * lanes:  # (the whole-row kernel's tile: a power of two)
        ap.error(f"--experts {E} and --lanes {lanes} must be powers of two with --experts at least 8 x --lanes")
    block_t = 32 // lanes
    grid = (triton.cdiv(T, block_t),)
    x = (torch.randn((T, E), device="cuda") * 2).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda") * 0.05
    words = x.view(torch.int32)
    out = torch.empty(T, dtype=torch.int32, device="cuda")
    w = torch.empty((T, 8), device="cuda")
    ids = torch.empty((T, 8), dtype=torch.int32, device="cuda")
    config = LaunchConfig(block_t=block_t, chunk=lanes, num_warps=1, algorithm="rows")
    runs = {
        "empty": lambda: _empty[grid](out, num_warps=1),
        "own-loads": lambda: _own_loads[grid](words, out, T, E // 2, BLOCK_T=block_t, LANES=lanes,
                                              ITERS=E // (8 * lanes), num_warps=1),
        "coalesced": lambda: _coalesced[grid](words, out, T, E // 2, BLOCK_T=block_t, WORDS=E // 2, num_warps=1),
        "rows": lambda: fused_musespark1x_routing(x, bias, 8, 2.5, topk_weights=w, topk_ids=ids, config=config),
    }
    ref = words[:, 0].clone()  # each row's XOR: what the two load kernels must store
    for j in range(1, words.shape[1]):
        ref ^= words[:, j]
    rows = []
    for name, fn in runs.items():
        out.zero_()
        fn()
        torch.cuda.synchronize()
        if name in ("own-loads", "coalesced") and not torch.equal(out, ref):
            raise SystemExit(f"{name}: the rows' XOR differs from torch's (a load kernel read the wrong words)")
        us = triton.testing.do_bench_cudagraph(fn, rep=20, quantiles=[0.5])
        us = (us[0] if isinstance(us, (list, tuple)) else us) * 1e3
        gbps = 0.0 if name == "empty" else T * E * 2 / (us * 1e3)
        rows.append((name, T, E, lanes, round(us, 2), round(gbps)))
        print(f"{name:<10} {T} x {E} bf16, {lanes} threads a token, {grid[0]} one-warp programs: "
              f"{us:7.2f} us  {gbps:6.0f} GB/s of logits")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            out_csv = csv.writer(f)
            out_csv.writerow(["kernel", "tokens", "experts", "lanes", "us", "gbps"])
            out_csv.writerows(rows)


if __name__ == "__main__":
    main()
