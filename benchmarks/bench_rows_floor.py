"""The floors under the rows kernel's large-batch launch: what its grid and its load pattern cost alone.

Times, with CUDA-graph medians, on one shape (default 65536 x 256 bf16, two threads a token, one-warp programs):

* ``empty``: a one-warp program that does nothing, on the rows launch's grid (the block launcher's floor);
* ``own-loads``: each thread reads its token's chunks as the rows kernel does (16 bytes a chunk, chunk
  ``i * LANES + lane`` in iteration ``i``, a row's threads adjacent), XORs them and stores a word a token: the
  kernel's memory traffic and pattern without its arithmetic (every load in flight at once: unrolled);
* ``coalesced``: the same bytes read as whole rows (each warp's loads contiguous), the pattern's alternative;
* ``keys``: the own loads and the router's window keys (sigmoid, bias, clamp, expert bits: ``_row_keys``), each
  chunk's keys folded by a maximum instead of the selection network, the largest key's expert stored: the
  arithmetic without the selection;
* ``select``: the router's whole selection (``_row_select``: loads, keys, the network and the lanes' merge), the
  picks' experts stored: the router without its redo vote, the picks' logits, weights and padding;
* ``select-tma-tN-sS[-wW][-pdl]``: that selection with the logits and the bias copied into shared memory by the
  tensor-memory accelerator (Hopper's TMA, through Triton tensor descriptors), a block of N chunks a thread each
  loop step, S stages in flight, programs of W warps (default 1), ``-pdl`` started early as the router is; each
  thread reads its chunks from shared memory (no per-thread global loads);
* ``rows``: the router itself (``fused_musespark1x_routing`` with that launch; it also starts each launch early
  with PDL, which the others do not).

Then the host's time per eager call of ``select`` and of ``select-tma-t4-s3`` (whose launch builds two
``TensorDescriptor`` objects each call), as ``routetool bench`` measures host cost.

Each kernel is checked before it is timed: the load kernels against torch's XOR of each row, keys and the
selections against the router's picks. A timed call takes the next of ``--sets`` input sets (by default as
``routetool bench``: enough to exceed twice the L2, so that the logits come from HBM).

Usage (GPU machine, repository root; ``bash benchmarks/gpu.sh floor`` runs it with its defaults):
    python benchmarks/bench_rows_floor.py [--tokens 65536] [--experts 256] [--lanes 2] [--sets 0] [--csv benchmarks/results.csv]

With ``--csv`` its rows (benchmark ``floor``, a case per kernel, latency_us_p50 and host_us_p50) are appended to
that results file with the date and the commit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

from triton.tools.tensor_descriptor import TensorDescriptor

from routetool_kernels import fused_musespark1x_routing
from routetool_kernels.routing_jit import (_keep_best8, _key_ids, _load_chunk, _merge_lanes, _row_keys, _row_select,
                                           _sort8, _tile_chunks, _window_base)
from routetool_kernels.routing_policy import LaunchConfig, rows_index_bits, rows_loads

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402 - benchmarks/results.py, the one results file


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


@triton.jit
def _keys(x_ptr, bias_ptr, ids_ptr, num_tokens, num_experts, stride_m, BLOCK_T: tl.constexpr, LANES: tl.constexpr,
          ITERS: tl.constexpr, INDEX_BITS: tl.constexpr, E_POW2: tl.constexpr, FAST_MATH: tl.constexpr):
    """Each row's best expert by the router's window keys (``x_ptr``: bf16 as int32 words, float32 bias), the keys
    folded by a maximum: :func:`_own_loads` plus the key arithmetic, without the selection network."""
    base_bits, _ = _window_base(bias_ptr, num_experts, 1, INDEX_BITS, E_POW2, FAST_MATH)
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_off = tl.minimum(row, num_tokens - 1).to(tl.int64) * stride_m
    base = x_ptr + row_off[:, None, None]
    bbase = bias_ptr + tl.zeros_like(row_off[:, None, None])
    key_scale = ((1 << INDEX_BITS) | (row_off >> 63).to(tl.int32)).to(tl.uint32, bitcast=True)[:, None]
    lane = tl.arange(0, LANES)[None, :]
    col = tl.arange(0, 4)[None, None, :]
    nan_sum = tl.zeros([BLOCK_T, LANES], tl.float32)
    best = tl.zeros([BLOCK_T, LANES], tl.uint32)
    for i in tl.static_range(ITERS):
        c = i * LANES + lane
        w = tl.load(base + c[:, :, None] * 4 + col)
        qlo, qhi = _load_chunk(bbase, col, c[:, :, None], num_experts, 1, 4, False)
        keys, nan_sum = _row_keys(w, w, qlo, qhi, num_experts, 1.0, base_bits, nan_sum, c, key_scale, 8, 4, False,
                                  INDEX_BITS, False, False, FAST_MATH, True)
        for j in tl.static_range(8):
            best = tl.maximum(best, keys[j])
    top = tl.max(best, axis=1)
    top = tl.where(nan_sum.sum(axis=1) == nan_sum.sum(axis=1), top, 0)  # (the row sum kept, as the router keeps it)
    ids = _key_ids((top,), 1, INDEX_BITS)
    tl.store(ids_ptr + row, ids[0], mask=row < num_tokens)


@triton.jit
def _select(x_ptr, bias_ptr, ids_ptr, num_tokens, num_experts, stride_m, BLOCK_T: tl.constexpr, LANES: tl.constexpr,
            ITERS: tl.constexpr, INDEX_BITS: tl.constexpr, E_POW2: tl.constexpr, AHEAD: tl.constexpr,
            FAST_MATH: tl.constexpr):
    """Each row's 8 picks by the router's own selection (``x_ptr``: bf16 logits, float32 bias; ``ids_ptr``: (T, 8)
    int32), without its redo vote, its picks' logits, weights or padding."""
    base_bits, _ = _window_base(bias_ptr, num_experts, 1, INDEX_BITS, E_POW2, FAST_MATH)
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_off = tl.minimum(row, num_tokens - 1).to(tl.int64) * stride_m
    keys, nan_sum = _row_select(x_ptr, bias_ptr, row_off, num_experts, 1, 1, 1.0, base_bits, ITERS, LANES, 8, 4,
                                False, INDEX_BITS, False, False, FAST_MATH, AHEAD, 0, True)
    ids = _key_ids(keys, 8, INDEX_BITS)
    ok = (row < num_tokens) & (nan_sum == nan_sum)
    for k in tl.static_range(8):
        tl.store(ids_ptr + row * 8 + k, ids[k], mask=ok)


@triton.jit
def _select_tma(desc, bias_desc, bias_ptr, ids_ptr, num_tokens, num_experts, BLOCK_T: tl.constexpr, LANES: tl.constexpr,
                TILE: tl.constexpr, INDEX_BITS: tl.constexpr, E_POW2: tl.constexpr, STAGES: tl.constexpr,
                FAST_MATH: tl.constexpr, USE_PDL: tl.constexpr):
    """:func:`_select` with the logits copied into shared memory by the tensor-memory accelerator (``desc``: a
    descriptor of the bf16 logits as int32 words, blocks of ``BLOCK_T`` rows x ``LANES * TILE * 4`` words), a
    block a loop step in a pipeline of ``STAGES``, each lane taking ``TILE`` chunks of every block; the float32
    bias the same way (``bias_desc``: ``(1, E)``, blocks of the step's ``LANES * TILE * 8`` experts), so that the
    pipeline holds no per-thread copies of it."""
    W: tl.constexpr = LANES * TILE * 4
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    base_bits, _ = _window_base(bias_ptr, num_experts, 1, INDEX_BITS, E_POW2, FAST_MATH)
    row0 = tl.program_id(0) * BLOCK_T
    row = row0 + tl.arange(0, BLOCK_T)
    row_off = row.to(tl.int64) * num_experts
    key_scale = ((1 << INDEX_BITS) | (row_off >> 63).to(tl.int32)).to(tl.uint32, bitcast=True)[:, None]
    lane = tl.arange(0, LANES)[None, :]
    nan_sum = tl.zeros([BLOCK_T, LANES], tl.float32)
    t0 = tl.zeros([BLOCK_T, LANES], tl.uint32)
    best = (t0, t0, t0, t0, t0, t0, t0, t0)
    for i in tl.range(0, num_experts // (2 * W), num_stages=STAGES):
        x = desc.load([row0, i * W])
        chunks = _tile_chunks(x, LANES, TILE, True)
        bchunks = _tile_chunks(bias_desc.load([0, i * 2 * W]), LANES, TILE)
        for g in tl.static_range(TILE):
            c = (i * TILE + g) * LANES + lane
            keys, nan_sum = _row_keys(chunks[g], chunks[g], bchunks[g], bchunks[g], num_experts, 1.0, base_bits,
                                      nan_sum, c, key_scale, 8, 8, False, INDEX_BITS, False, False, FAST_MATH, True)
            best = _keep_best8(best, _sort8(*keys))
    keys = tl.reduce(best, 1, _merge_lanes)
    ids = _key_ids(keys, 8, INDEX_BITS)
    ok = (row < num_tokens) & (tl.sum(nan_sum, axis=1) == tl.sum(nan_sum, axis=1))
    for k in tl.static_range(8):
        tl.store(ids_ptr + row * 8 + k, ids[k], mask=ok)


# the TMA selection's launches: (chunks a thread a step, pipeline stages, warps a program, PDL)
TMA_VARIANTS = [(2, 3, 1, False), (4, 2, 1, False), (4, 3, 1, False), (8, 2, 1, False), (4, 2, 2, False),
                (4, 3, 2, False), (4, 3, 4, False), (4, 3, 1, True), (4, 3, 2, True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--experts", type=int, default=256, help="a power of two, 8 x --lanes or more (default 256)")
    ap.add_argument("--lanes", type=int, default=2, help="threads a token of the rows launch (default 2)")
    ap.add_argument("--sets", type=int, default=0,
                    help="input sets a timed call rotates through (default 0: as routetool bench, enough to exceed "
                         "twice the L2, so that the logits come from HBM; 1: the same logits every call, from L2)")
    ap.add_argument("--csv", default="", help="results file to append the rows to (benchmark floor; default none)")
    a = ap.parse_args()
    T, E, lanes = a.tokens, a.experts, a.lanes
    if E & (E - 1) or lanes & (lanes - 1) or E < 8 * lanes:  # (the whole-row kernel's tile: a power of two)
        ap.error(f"--experts {E} and --lanes {lanes} must be powers of two with --experts at least 8 x --lanes")
    block_t = 32 // lanes
    grid = (triton.cdiv(T, block_t),)
    bias = torch.randn(E, device="cuda") * 0.05
    # input sets, each with its own outputs: a call takes the next, so that with --sets 0 (as routetool bench) the
    # logits come from HBM rather than from an L2 that still holds them from the call before
    one = T * E * 2
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n_sets = a.sets or (max(1, min(16, -(-2 * l2 // one))) if one < 2 * l2 else 1)
    config = LaunchConfig(block_t=block_t, chunk=lanes, num_warps=1, algorithm="rows")
    _, ahead, iters = rows_loads(E, 2, lanes)
    kbits = dict(INDEX_BITS=rows_index_bits(E), E_POW2=E, FAST_MATH=True)  # (the router's math on a GPU)

    def make_runs():
        x = (torch.randn((T, E), device="cuda") * 2).to(torch.bfloat16)
        words = x.view(torch.int32)
        out = torch.zeros(T, dtype=torch.int32, device="cuda")
        w = torch.empty((T, 8), device="cuda")
        ids = torch.zeros((T, 8), dtype=torch.int32, device="cuda")
        sel = torch.zeros((T, 8), dtype=torch.int32, device="cuda")
        runs = {
            "empty": lambda: _empty[grid](out, num_warps=1),
            "own-loads": lambda: _own_loads[grid](words, out, T, E // 2, BLOCK_T=block_t, LANES=lanes,
                                                  ITERS=E // (8 * lanes), num_warps=1),
            "coalesced": lambda: _coalesced[grid](words, out, T, E // 2, BLOCK_T=block_t, WORDS=E // 2, num_warps=1),
            "keys": lambda: _keys[grid](words, bias, out, T, E, E // 2, BLOCK_T=block_t, LANES=lanes, ITERS=iters,
                                        num_warps=1, **kbits),
            "select": lambda: _select[grid](x, bias, sel, T, E, E, BLOCK_T=block_t, LANES=lanes, ITERS=iters,
                                            AHEAD=ahead, num_warps=1, **kbits),
            **{f"select-tma-t{tile}-s{st}" + (f"-w{nw}" if nw > 1 else "") + ("-pdl" if pdl else ""):
               (lambda tile=tile, st=st, nw=nw, pdl=pdl: _select_tma[(triton.cdiv(T, block_t * nw),)](
                   TensorDescriptor.from_tensor(words, [block_t * nw, lanes * tile * 4]),
                   TensorDescriptor.from_tensor(bias.view(1, E), [1, lanes * tile * 8]), bias, sel, T, E,
                   BLOCK_T=block_t * nw, LANES=lanes, TILE=tile, STAGES=st, USE_PDL=pdl, num_warps=nw,
                   **({"launch_pdl": True} if pdl else {}), **kbits))
               for tile, st, nw, pdl in TMA_VARIANTS if E >= 16 * lanes * tile},
            "rows": lambda: fused_musespark1x_routing(x, bias, 8, 2.5, topk_weights=w, topk_ids=ids, config=config),
        }
        return runs, words, out, ids, sel

    sets = [make_runs() for _ in range(n_sets)]
    runs, words, out, ids, sel = sets[0]  # the checks read the first set
    ref = words[:, 0].clone()  # each row's XOR: what the two load kernels must store
    for j in range(1, words.shape[1]):
        ref ^= words[:, j]
    runs["rows"]()  # the router's picks: what keys (its first) and select (all 8) must store
    torch.cuda.synchronize()
    picks = ids.clone()

    def rotating(name):
        calls = [s[0][name] for s in sets]
        state = [0]

        def call():
            calls[state[0] % len(calls)]()
            state[0] += 1
        return call

    rows = []
    for name, fn in runs.items():
        out.zero_()
        sel.zero_()
        fn()
        torch.cuda.synchronize()
        if name in ("own-loads", "coalesced") and not torch.equal(out, ref):
            raise SystemExit(f"{name}: the rows' XOR differs from torch's (a load kernel read the wrong words)")
        if name == "keys" and not torch.equal(out, picks[:, 0]):
            raise SystemExit("keys: a row's best expert differs from the router's first pick")
        if name.startswith("select") and not torch.equal(sel, picks):
            raise SystemExit("select: a row's picks differ from the router's")
        us = triton.testing.do_bench_cudagraph(rotating(name), rep=20, quantiles=[0.5])
        us = (us[0] if isinstance(us, (list, tuple)) else us) * 1e3
        gbps = 0.0 if name == "empty" else T * E * 2 / (us * 1e3)
        rows.append([name, us])
        warps = name.split("-w")[1][0] if "-w" in name else "1"
        programs = f"{grid[0]} one-warp programs" if warps == "1" else f"programs of {warps} warps"
        print(f"{name:<16} {T} x {E} bf16, {lanes} threads a token, {programs}, {n_sets} sets: "
              f"{us:7.2f} us  {gbps:6.0f} GB/s of logits")
    # the host's cost of a launch that builds its two tensor descriptors (Python objects, encoded at each launch)
    # against one that passes pointers: eager back-to-back calls, the GPU's work not in it
    from routetool.analysis.bench import host_latencies
    host = dict(zip(("select", "select-tma-t4-s3"), host_latencies([runs["select"], runs["select-tma-t4-s3"]])))
    for name, lat in host.items():
        rows.append([name, lat.p50_us, "host_us_p50"])
        print(f"{name + ' host':<16} eager call, host time (p50): {lat.p50_us:7.2f} us")
    if a.csv:
        machine = torch.cuda.get_device_name()
        results.append([[machine, "floor", f"{name} T={T} E={E} bf16 threads={lanes} sets={n_sets}", metric[0] if metric
                         else "latency_us_p50", f"{us:.4g}", "us"] for name, us, *metric in rows], a.csv)


if __name__ == "__main__":
    main()
