"""Sweep launch configs of the tiled kernel on a GPU; writes a long-format CSV.

Usage (GPU machine, repository root):
    python benchmarks/tune_tiled.py --out $OUT/tune.csv [--quick]
    python benchmarks/tune_tiled.py --two-level --out $OUT/tune-two-level.csv   # scan vs two-level, by size
    python benchmarks/tune_tiled.py --two-level --tokens 65536 --launches 1:32:0,2:18:56,4:10:48 \
        --experts 256:fp32,256:bf16 --out $OUT/tune.csv
    python benchmarks/tune_tiled.py --rows --tokens 65536 --experts 256:bf16 --rows-launches 1:2,2:4 \
        --variant ";ROWS_AHEAD=1;ROWS_TILE=8" --out $OUT/tune.csv   # each ';'-set of policy switches in turn

Every config is checked against the reference (ids equal, weights close) before timing;
inputs rotate over enough buffers to defeat the L2 cache at large sizes.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time

import torch
import triton
import triton.testing

from routetool_kernels import fused_musespark1x_routing, fused_musespark1x_routing_seed, musespark1x_routing_reference
from routetool_kernels.reference import biased_scores, normalized_scores
from routetool_kernels.routing_policy import LaunchConfig, default_config, padded_num_experts, two_level_config
from routetool.engine.compare import RowClass, compare_step, weight_tolerance

L2_BYTES = 60 * 2**20


def rotating_inputs(T, E, dtype, seed=0):
    bytes_one = T * E * torch.finfo(dtype).bits // 8
    n = max(1, min(16, (4 * L2_BYTES) // max(bytes_one, 1)))
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = [(torch.randn((T, E), device="cuda", generator=g) * 2).to(dtype) for _ in range(n)]
    bias = torch.randn(E, device="cuda", generator=g) * 0.05
    return xs, bias


def time_fn(fn, xs, bias, T, K, **kw):
    w = torch.empty((T, K), device="cuda")
    ids = torch.empty((T, K), dtype=torch.int32, device="cuda")
    state = {"i": 0}

    def call():
        x = xs[state["i"] % len(xs)]
        state["i"] += 1
        fn(x, bias, K, 2.5, topk_weights=w, topk_ids=ids, **kw)

    q = triton.testing.do_bench_cudagraph(call, rep=10, quantiles=[0.1, 0.5, 0.9])
    return [v * 1e3 for v in q]


def check(fn, x, bias, K, **kw):
    """No mismatch or invalid row and weights within tolerance (tie-aware, as replay checks)."""
    w, ids = fn(x, bias, K, 2.5, **kw)
    pad = kw.get("is_padding")
    rw, rids = musespark1x_routing_reference(x, bias, K, 2.5, is_padding=pad)
    scores = normalized_scores(x)
    cmp = compare_step(ids, w, rids, rw, scores, biased_scores(scores, bias), pad, tie_ulps=16,
                       tolerance=weight_tolerance(torch.float32, 2.5))
    bad = (cmp.row_class == RowClass.MISMATCH) | (cmp.row_class == RowClass.INVALID) | cmp.weight_over_tol
    return not bool(bad.any())


def configs(E, dtype, T, quick):
    """Candidate launch configs: latency-oriented for small batches, throughput-oriented for large."""
    e_pad = padded_num_experts(E)
    vec = 16 // dtype.itemsize
    out = []
    if T <= 64:
        # 32 lanes per row (few elements per thread, short dependency chains)
        chunk = min(e_pad, 32 * vec)
        for bt, nw in ((1, 1), (2, 2), (4, 4), (4, 1)):
            out.append(LaunchConfig(block_t=bt, chunk=chunk, num_warps=nw))
    else:
        for lanes in (8, 16, 32):
            chunk = min(e_pad, lanes * vec)
            lanes = chunk // vec
            for nw in (4, 8):
                for mult in (1, 2):
                    bt = (32 // lanes) * nw * mult
                    out.append(LaunchConfig(block_t=bt, chunk=chunk, num_warps=nw))
    return list(dict.fromkeys(out))


PER_SM = (0, 16, 24, 28, 32)
TWO_LEVEL_TOKENS = (65536, 16384, 4096, 1024, 256)
MAX_REGISTERS = (0,)


def two_level_configs(E, K, per_sm_values=PER_SM, register_limits=MAX_REGISTERS, launches=None):
    """Two-level candidates, one token per warp: every ``per_sm`` x ``register_limits`` with one
    warp per program, or the given ``launches`` (``(num_warps, programs_per_sm, max_registers)``
    triples; a program of ``num_warps`` warps routes ``num_warps`` tokens per tile)."""
    e_pad = padded_num_experts(E)
    if launches is None:
        launches = [(1, per_sm, regs) for per_sm in per_sm_values for regs in register_limits]
    launches = [tuple(launch) + (0,) * (4 - len(launch)) for launch in launches]
    out = []
    for chunk in (32, 64):
        if K <= chunk <= e_pad:
            for nw, per_sm, regs, dynamic in launches:
                out.append(LaunchConfig(block_t=nw, chunk=chunk, num_warps=nw, algorithm="two_level",
                                        programs_per_sm=per_sm, max_registers=regs,
                                        dynamic_tiles=bool(dynamic) and per_sm > 0))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-s", type=float, default=240, help="stop sweeping after this many seconds")
    ap.add_argument("--large-only", action="store_true", help="only num_tokens=65536")
    ap.add_argument("--two-level", action="store_true", help="two-level configs against the scan defaults, by size")
    ap.add_argument("--rows", action="store_true",
                    help="the rows algorithm (2 to 8 warps a program, 1 to 8 threads a token) against two-level, by "
                         "size (as --two-level)")
    ap.add_argument("--tokens", default=None, help="comma-separated num_tokens for --two-level")
    ap.add_argument("--per-sm", default=None, help="comma-separated programs_per_sm for --two-level")
    ap.add_argument("--max-registers", default=None, help="comma-separated max_registers for --two-level")
    ap.add_argument("--launches", default=None,
                    help="comma-separated num_warps:programs_per_sm:max_registers[:dynamic_tiles 0|1] for --two-level "
                         "(instead of --per-sm x --max-registers with one warp per program)")
    ap.add_argument("--experts", default=None, help="comma-separated E:dtype shapes for --two-level, e.g. 256:fp32,384:fp32")
    ap.add_argument("--padding", type=float, default=0.0,
                    help="pass an is_padding mask with this fraction of the rows padded (random; 0: no mask)")
    ap.add_argument("--variant", default="",
                    help="comma-separated NAME=INT switches of routetool_kernels.routing_policy to set first (experiments, "
                         "e.g. DYNAMIC_TILES_FROM=1); several such sets separated by ';' are each swept in turn "
                         "(every candidate under every set); recorded in the CSV's variant column")
    ap.add_argument("--rows-launches", default="1:2,1:4,1:8,2:4,4:4,8:4",
                    help="comma-separated threads:warps[:max_registers] of the rows candidates (--rows)")
    ap.add_argument("--compile-only", action="store_true",
                    help="call every candidate once, unchecked and untimed (fills Triton's cache; run several such "
                         "processes side by side before the timed run)")
    args = ap.parse_args()
    from routetool_kernels import routing_policy
    from routetool_kernels._dispatch import clear_plans
    variant_sets = [v for v in args.variant.split(";")] if args.variant else [""]
    defaults = {}
    for vs in variant_sets:
        for item in filter(None, vs.split(",")):
            name, value = item.split("=")
            if not hasattr(routing_policy, name):
                sys.exit(f"routetool_kernels.routing_policy has no switch {name}")
            defaults.setdefault(name, getattr(routing_policy, name))

    def use_variant(vs):
        for name, value in defaults.items():
            setattr(routing_policy, name, value)
        for item in filter(None, vs.split(",")):
            name, value = item.split("=")
            setattr(routing_policy, name, int(value))
        clear_plans()
    props = torch.cuda.get_device_properties(0)
    if args.compile_only:
        copy_gbps = 4228.0
    else:
        src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
        copy_gbps = 2 * src.numel() / copy_ms / 1e6
        del src, dst
    print(f"{props.name}: copy bandwidth {copy_gbps:.0f} GB/s (read+write), torch {torch.__version__}, triton {triton.__version__}")
    rows = []
    shapes = [(T, E, dt) for E, dt in ((256, torch.float32), (256, torch.bfloat16), (384, torch.float32))
              for T in ((65536,) if args.large_only else (64, 65536))]
    per_sm_values = tuple(int(v) for v in args.per_sm.split(",")) if args.per_sm else PER_SM
    register_limits = tuple(int(v) for v in args.max_registers.split(",")) if args.max_registers else MAX_REGISTERS
    if args.two_level or args.rows:
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else TWO_LEVEL_TOKENS
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
        experts = ([(int(e), dtypes[d]) for e, d in (v.split(":") for v in args.experts.split(","))] if args.experts
                   else [(256, torch.float32), (256, torch.bfloat16), (384, torch.float32), (512, torch.float32),
                         (128, torch.float32)])
        shapes = [(T, E, dt) for E, dt in experts for T in tokens]
    t0 = time.time()
    for T, E, dtype in shapes:
        if time.time() - t0 > args.budget_s:
            print("time budget spent; stopping the sweep", flush=True)
            break
        K = 8
        xs, bias = rotating_inputs(T, E, dtype)
        pad_kw = {}
        if args.padding:
            g = torch.Generator(device="cuda").manual_seed(T + E)
            pad_kw = {"is_padding": torch.rand(T, device="cuda", generator=g) < args.padding}
        floor_us = (T * E * xs[0].element_size() + T * K * 8) / (copy_gbps * 1e3)
        if args.rows:
            cands = [("tiled", two_level_config(T, E, K))]
            for v in args.rows_launches.split(","):
                lanes, nw, regs = (tuple(int(p) for p in v.split(":")) + (0,))[:3]
                cands.append(("tiled", LaunchConfig(block_t=32 * nw // lanes, chunk=lanes, num_warps=nw,
                                                    algorithm="rows", max_registers=regs)))
        elif args.two_level:
            cands = [("tiled", default_config(1, E, dtype)), ("tiled", default_config(4096, E, dtype, topk=K + 100))]
            launches = ([tuple(int(p) for p in v.split(":")) for v in args.launches.split(",")] if args.launches
                        else None)
            cands += [("tiled", cfg) for cfg in two_level_configs(E, K, per_sm_values, register_limits, launches)]
        else:
            cands = [("tiled", cfg) for cfg in configs(E, dtype, T, args.quick)]
        if dtype == torch.float32 and not args.two_level:
            cands.append(("seed", None))
        best = None
        # the switch sets are experiments on the rows algorithm: other candidates run once, under the first
        runs = [(vs, name, cfg) for vs in variant_sets for name, cfg in cands
                if vs == variant_sets[0] or (cfg is not None and cfg.algorithm == "rows")]
        for vs, name, cfg in runs:
            use_variant(vs)
            fn = fused_musespark1x_routing_seed if name == "seed" else fused_musespark1x_routing
            kw = ({} if cfg is None else {"config": cfg}) | (pad_kw if name == "tiled" else {})
            if args.compile_only:
                fn(xs[0], bias, K, 2.5, **kw)
                print(f"compiled T={T} E={E} {dtype} {vs} {cfg}", flush=True)
                continue
            ok = check(fn, xs[0], bias, K, **kw)  # the whole shape: the persistent loop and its tile claims
            p10, p50, p90 = time_fn(fn, xs, bias, T, K, **kw) if ok else (float("nan"),) * 3
            row = dict(variant=name + (f"[{vs}]" if vs and name == "tiled" else ""), num_tokens=T, num_experts=E, topk=K, dtype=str(dtype).removeprefix("torch."),
                       block_t=cfg.block_t if cfg else "", chunk=cfg.chunk if cfg else "",
                       num_warps=cfg.num_warps if cfg else "", algorithm=cfg.algorithm if cfg else "",
                       programs_per_sm=cfg.programs_per_sm if cfg else "",
                       max_registers=cfg.max_registers if cfg else "",
                       dynamic_tiles=cfg.dynamic_tiles if cfg else "", correct=ok, p10_us=p10, p50_us=p50, p90_us=p90,
                       floor_us=floor_us, padding=args.padding, is_default=cfg == default_config(T, E, dtype, topk=K) if cfg else "")
            rows.append(row)
            print(f"  {row['variant']:<40} {cfg.algorithm if cfg else '':<9} bt={row['block_t']} chunk={row['chunk']} "
                  f"w={row['num_warps']} sm={row['programs_per_sm']} r={row['max_registers']}: {p50:.2f} us (p10 {p10:.2f}, p90 {p90:.2f}){'' if ok else ' WRONG'}", flush=True)
            if ok and name == "tiled" and (best is None or p50 < best["p50_us"]):
                best = row
        if args.compile_only:
            del xs
            continue
        default = next(r for r in rows[-len(runs):] if r["is_default"] is True) if any(
            r["is_default"] is True for r in rows[-len(runs):]) else None
        seed = next((r for r in rows[-len(runs):] if r["variant"] == "seed"), None)
        print(f"T={T:>6} E={E} {str(dtype)[6:]:>8}: best {best['p50_us']:.2f}us "
              f"(bt={best['block_t']} chunk={best['chunk']} w={best['num_warps']} {best['algorithm']} "
              f"per_sm={best['programs_per_sm']} regs={best['max_registers']} dynamic={best['dynamic_tiles']}), "
              f"default {default['p50_us'] if default else float('nan'):.2f}us, "
              f"seed {seed['p50_us'] if seed else float('nan'):.2f}us, floor {floor_us:.2f}us  [{time.time() - t0:.0f}s]",
              flush=True)
        del xs
        with open(args.out, "w", newline="") as fh:  # rewritten after every shape: survives a timeout
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    if args.compile_only:
        return
    with open(args.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    bad = [r for r in rows if not r["correct"]]
    if bad:
        print(f"{len(bad)} configs gave wrong results: {bad[:3]}")
        sys.exit(1)


if __name__ == "__main__":
    main()
