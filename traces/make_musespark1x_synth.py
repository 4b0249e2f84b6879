"""Make traces/musespark1x-synth-bf16.safetensors (see traces/README.md).

Run from the repository root: python traces/make_musespark1x_synth.py [--force]
"""

import sys

import torch

from routetool.capture.synth import SynthSpec, synthesize
from routetool.io.trace import RouterConfig, write_trace

OUT = "traces/musespark1x-synth-bf16.safetensors"

spec = SynthSpec(
    num_layers=4,
    router=RouterConfig(num_experts=256, topk=8, route_scale=2.5, router_score_normalization="sigmoid"),
    dtype=torch.bfloat16,
    prefill_chunks=(384, 97),
    decode_steps=24,
    max_decode_batch=40,
    skew="imbalance:4",
    bias="fitted",
    bias_update_rate=1e-3,
    fit_steps=20,
    ties=6,
    nonfinite=0,
    seed=20261130,
    affinity=1.5,
    model="MuseSpark1x-shaped synthetic (256 experts, top-8, sigmoid, bf16)",
)
meta, layers = synthesize(spec)
write_trace(OUT, meta, layers, force="--force" in sys.argv)
print(f"wrote {OUT}")
