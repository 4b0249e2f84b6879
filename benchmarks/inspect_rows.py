"""Registers, shared memory and a count of the memory instructions of the rows kernel's default 65536 x 256 bf16
launch (two threads a token, one-warp programs), compiled offline for sm_90 (no GPU needed), with its tiles
copied by the TMA (``1``) or the threads' own loads (``0``).

Usage (repository root, the kernel package importable as routetool_kernels):
    python benchmarks/inspect_rows.py 1 [STAGES [EXPERTS [MAXNREG]]] [--dump DIR]

``STAGES``: the TMA launch's tiles in flight (default 3); ``EXPERTS``: 128 or 256 (default 256); ``MAXNREG``: a
register limit (0: the compiler's choice); ``--dump DIR`` writes the SASS and the TTGIR there; ``REDO_OWN=1`` in the
environment compiles the redo as ``ROWS_REDO_OWN_LOADS`` does.
"""

import collections
import os
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from routetool_kernels.routing_jit import _rows_kernel
argv = sys.argv[1:]
dump = None
if "--dump" in argv:
    dump = argv[argv.index("--dump") + 1]
    argv = argv[:argv.index("--dump")]
argv += [None] * 4
tma = argv[0] == "1"
stages = int(argv[1] or 3)
experts = int(argv[2] or 256)
maxnreg = int(argv[3] or 0)
tile = 4 if tma else 0
sig = {"gating_output_ptr": "*bf16", "bias_ptr": "*fp32", "topk_weights_ptr": "*fp32", "topk_ids_ptr": "*i32",
       "is_padding_ptr": "*i1", "num_tokens": "i32", "num_experts": "i32", "stride_gm": "i32", "stride_gn": "constexpr",
       "stride_bias": "constexpr", "stride_wm": "i32", "stride_wk": "i32", "stride_im": "i32", "stride_ik": "i32",
       "stride_pad": "constexpr", "router_output_multiplier": "fp32", "route_scale": "fp32", "division_eps": "fp32",
       "logits_desc": "tensordesc<i32[16, 32]>" if tma else "constexpr", "bias_desc": "tensordesc<fp32[1, 64]>" if tma else "constexpr"}
const = {"stride_gn": 1, "stride_bias": 1, "stride_pad": 1, "TOPK": 8, "BLOCK_T": 16, "ITERS": experts // (16 * max(tile, 1)), "LANES": 2,
         "VEC": 8, "BIAS_VEC": 4, "MASK_EXPERTS": False, "INDEX_BITS": (experts - 1).bit_length(), "E_POW2": experts, "HAS_MULTIPLIER": False,
         "HAS_EPS": False, "USE_PDL": True, "FAST_MATH": True, "PICK_BITS": 14, "AHEAD": 1 if tma else 4, "TILE": tile,
         "WORDS": True, "TMA": tma, "STAGES": stages if tma else 1,
         "REDO_OWN": os.environ.get("REDO_OWN", "0") == "1"}
if not tma:
    const["logits_desc"] = None; const["bias_desc"] = None
for k in const:
    sig.setdefault(k, "constexpr")
k = triton.compile(ASTSource(_rows_kernel, sig, const), target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, **({"maxnreg": maxnreg} if maxnreg else {})})
if dump:
    os.makedirs(dump, exist_ok=True)
    open(os.path.join(dump, "rows.ttgir"), "w").write(k.asm["ttgir"])
open("/tmp/r.cubin", "wb").write(k.asm["cubin"])
sass = subprocess.run([triton.__path__[0] + "/backends/nvidia/bin/cuobjdump", "-sass", "/tmp/r.cubin"], capture_output=True, text=True).stdout
if dump:
    open(os.path.join(dump, "rows.sass"), "w").write(sass)
ins = [l for l in sass.splitlines() if l.strip().startswith("/*") and "*/" in l and len(l.split()) > 2]
ops = collections.Counter((l.split()[2] if l.split()[1].startswith("@") else l.split()[1]).split(".")[0] for l in ins)
print("tma", tma, "stages", stages, "experts", experts, "maxnreg", maxnreg, "regs", subprocess.run([triton.__path__[0] + "/backends/nvidia/bin/cuobjdump", "-res-usage", "/tmp/r.cubin"], capture_output=True, text=True).stdout.split("REG:")[1].split()[0], "smem", k.metadata.shared, "sass", len(ins),
      {o: c for o, c in ops.items() if o.startswith(("LDG", "LDS", "UTMA", "LDGSTS", "STL", "LDL", "SYNCS", "BAR", "STG"))})
