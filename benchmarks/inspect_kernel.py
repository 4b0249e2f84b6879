"""Compile the tiled kernel for sm_90 without a GPU and print its layouts and register use.

Usage: python benchmarks/inspect_kernel.py --experts 256 --dtype bf16 --block-t 16 --chunk 64 --warps 4
       python benchmarks/inspect_kernel.py --algorithm two_level --experts 256 --dtype bf16 --block-t 1 --chunk 32 --warps 1
Uses Triton's own compiler and its bundled ptxas; no device needed.
"""

import argparse
import glob
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from routetool_kernels.routing_jit import _routing_kernel, _two_level_kernel
from routetool_kernels.routing_policy import PING_PONG_MAX_SLICES, padded_num_experts, sum_bits

ap = argparse.ArgumentParser()
ap.add_argument("--experts", type=int, default=256)
ap.add_argument("--topk", type=int, default=8)
ap.add_argument("--dtype", default="bf16")
ap.add_argument("--block-t", type=int, default=16)
ap.add_argument("--chunk", type=int, default=64)
ap.add_argument("--warps", type=int, default=4)
ap.add_argument("--softmax", action="store_true")
ap.add_argument("--algorithm", default="scan", choices=("scan", "two_level"))
ap.add_argument("--persistent", type=int, default=1)
ap.add_argument("--maxnreg", type=int, default=None)
ap.add_argument("--ping-pong", type=int, default=None, help="persistent loop over two tiles per iteration "
                "(0/1; default: as a launch chooses)")
ap.add_argument("--tokens", type=int, default=1, help="num_tokens (specialised as a launch would: divisible by 16 or not)")
ap.add_argument("--no-padding", action="store_true", help="is_padding=None (a constexpr, as a launch without it)")

ap.add_argument("--const", action="append", default=[], help="NAME=INT: a further constexpr of the kernel "
                "(an experimental switch), e.g. RCP_FMA_SLICES=4")
ap.add_argument("--dump", help="write ttgir/ptx/sass-relevant files to this folder")
a = ap.parse_args()

fn = _routing_kernel if a.algorithm == "scan" else _two_level_kernel
names = list(fn.arg_names)
sig = {n: "i32" for n in names}
sig.update(gating_output_ptr=f"*{a.dtype}", bias_ptr="*fp32", topk_weights_ptr="*fp32", topk_ids_ptr="*i32",
           is_padding_ptr="*i1", router_output_multiplier="fp32", route_scale="fp32", division_eps="fp32",
           **({"counter_ptr": "*i32"} if "counter_ptr" in names else {}))
consts = dict(stride_gn=1, stride_bias=1, stride_wk=1, stride_ik=1, stride_pad=1, TOPK=a.topk,
              TOPK_PADDED=triton.next_power_of_2(a.topk), NUM_CHUNKS=padded_num_experts(a.experts) // a.chunk,
              CHUNK=a.chunk, BLOCK_T=a.block_t, NORMALIZATION_MODE=int(a.softmax), HAS_MULTIPLIER=False,
              HAS_EPS=False, USE_PDL=True, FAST_MATH=True, TOTAL_BITS=sum_bits(padded_num_experts(a.experts)),
              PICK_BITS=sum_bits(a.topk))
if a.algorithm == "two_level":
    slices = -(-a.experts // a.chunk)
    consts.update(WIDTH=a.chunk, NUM_SLICES=slices, PERSISTENT=bool(a.persistent),
                  PING_PONG=bool(a.persistent) and (slices * a.block_t <= PING_PONG_MAX_SLICES * a.warps
                                                    if a.ping_pong is None else bool(a.ping_pong)),
                  MASK_EXPERTS=a.experts % a.chunk != 0)
    del consts["CHUNK"], consts["TOPK_PADDED"], consts["NUM_CHUNKS"]
for item in a.const:
    name, value = item.split("=")
    consts[name] = int(value)
if a.no_padding:
    consts.update(is_padding_ptr=None, stride_pad=0)
for n in fn.do_not_specialize:  # passed as runtime integers by a launch, not as the constant 1
    if consts.get(n) == 1:
        del consts[n]
for n in consts:
    sig[n] = "constexpr"
div16 = [["tt.divisibility", 16]]
# as a launch specialises them: pointers 16-byte aligned, integers by their value (rows of topk outputs)
values = dict(num_tokens=a.tokens, num_experts=a.experts, stride_gm=a.experts, stride_wm=a.topk, stride_im=a.topk)
attrs = {(names.index(n),): div16 for n in ("gating_output_ptr", "bias_ptr", "topk_weights_ptr", "topk_ids_ptr",
                                             "is_padding_ptr", *[n for n, v in values.items() if v % 16 == 0])}
src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=a.warps, **({"maxnreg": a.maxnreg} if a.maxnreg else {})))
for line in k.asm["ttgir"].splitlines():
    if line.startswith("#blocked") or line.startswith("#linear"):
        print(line)
print("shared memory bytes:", k.metadata.shared)
ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas"))[0]
with tempfile.TemporaryDirectory() as d:
    p = os.path.join(d, "k.ptx")
    open(p, "w").write(k.asm["ptx"])
    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", p, "-o", os.path.join(d, "k.o")],
                         capture_output=True, text=True)
    print(" ".join(re.findall(r"Used \d+ registers.*|\d+ bytes spill.*", out.stderr)))
    cubin = os.path.join(d, "k.cubin")
    open(cubin, "wb").write(k.asm["cubin"])
    cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
    sass = subprocess.run([cuobjdump, "--dump-sass", cubin], capture_output=True, text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass)
    from collections import Counter
    c = Counter(o.split(".")[0] for o in ops)
    print("sass instructions:", len(ops), "top:", ", ".join(f"{n}:{v}" for n, v in c.most_common(10)))
ptx = k.asm["ptx"]
print("ptx: shfl", ptx.count("shfl.sync"), "ld.global", ptx.count("ld.global"), "st.shared", ptx.count("st.shared"),
      "ld.shared", ptx.count("ld.shared"), "bar.sync", ptx.count("bar.sync"))
if a.dump:
    os.makedirs(a.dump, exist_ok=True)
    for key in ("ttgir", "ptx"):
        open(os.path.join(a.dump, f"routing.{key}"), "w").write(k.asm[key])
    open(os.path.join(a.dump, "routing.sass"), "w").write(sass)
