"""Run the router kernel a few times on one shape, for a profiler (``ncu``) to attach to.

Usage (GPU machine, repository root):
    ncu --kernel-name regex:_two_level_kernel --launch-skip 3 --launch-count 1 --section WarpStateStats \
        python benchmarks/profile_kernel.py --tokens 65536 --experts 256 --dtype fp32 --algorithm two_level
    PROFILE_ARGS="--dtype bf16 --algorithm rows --chunk 1 --warps 2 --variant ROWS_AHEAD=4" bash benchmarks/gpu.sh profile
"""

import argparse

import torch

from routetool_kernels.routing import fused_musespark1x_routing
from routetool_kernels.routing_policy import LaunchConfig, default_config

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=65536)
ap.add_argument("--experts", type=int, default=256)
ap.add_argument("--topk", type=int, default=8)
ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
ap.add_argument("--algorithm", default=None, choices=(None, "scan", "two_level", "rows"))
ap.add_argument("--block-t", type=int, default=1)
ap.add_argument("--chunk", type=int, default=32)
ap.add_argument("--warps", type=int, default=1)
ap.add_argument("--per-sm", type=int, default=32)
ap.add_argument("--calls", type=int, default=5)
ap.add_argument("--variant", default="",
                help="comma-separated NAME=INT switches of routetool_kernels.routing_policy (experiments)")
a = ap.parse_args()
from routetool_kernels import routing_policy  # noqa: E402
for item in filter(None, a.variant.split(",")):
    name, value = item.split("=")
    if not hasattr(routing_policy, name):
        ap.error(f"routetool_kernels.routing_policy has no switch {name}")
    setattr(routing_policy, name, int(value))
dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
x = (torch.randn(a.tokens, a.experts, device="cuda") * 2).to(dtype)
bias = torch.randn(a.experts, device="cuda") * 0.05
if a.algorithm is None:
    cfg = default_config(a.tokens, a.experts, dtype, topk=a.topk)
else:
    block_t = 32 * a.warps // a.chunk if a.algorithm == "rows" else a.block_t  # rows: --chunk threads a token
    cfg = LaunchConfig(block_t=block_t, chunk=a.chunk, num_warps=a.warps, algorithm=a.algorithm,
                       programs_per_sm=a.per_sm if a.algorithm == "two_level" else 0)
print(cfg)
for _ in range(a.calls):
    fused_musespark1x_routing(x, bias, a.topk, 2.5, config=cfg)
torch.cuda.synchronize()
