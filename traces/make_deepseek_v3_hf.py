"""Make traces/deepseek-v3-hf-tiny.safetensors from HF transformers' DeepSeek-V3 model code.

The model is transformers' own DeepseekV3ForCausalLM, built from a small config (4 layers,
the first dense, 3 MoE layers of 256 routed experts, top-8, n_group=1/topk_group=1,
routed_scaling_factor 2.5) with weights drawn from a seeded generator; nothing is
downloaded. Because HF initialises router weights at std 0.02 and the correction bias at 0
(an untrained router gives near-uniform sigmoid scores), the router weights are redrawn at
std 0.25 and the bias from N(0, 0.02^2), both seeded, to give logits and biases of the spread
trained routers show. The input is real English text (traces/text/public-domain-openings.txt),
tokenised as UTF-8 bytes: four prompts of 96 bytes in one prefill step, then 12 greedy decode
steps of 4 tokens. Hooks record each MoE layer's router logits and the model's own top-k ids
and weights, so replay checks the kernel against an implementation nobody here wrote.

Needs transformers (pip install -e .[capture]). Run from the repository root:
    python traces/make_deepseek_v3_hf.py [--force]
"""

import sys
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from routetool.capture.hf import HFRouterRecorder, router_modules
from routetool.io.trace import write_trace

OUT = "traces/deepseek-v3-hf-tiny.safetensors"
TEXT = Path("traces/text/public-domain-openings.txt")
SEED = 1234
PROMPTS, PROMPT_BYTES, DECODE_STEPS = 4, 96, 12

config = DeepseekV3Config(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
torch.manual_seed(SEED)
model = DeepseekV3ForCausalLM(config).eval()
gen = torch.Generator().manual_seed(SEED)
with torch.no_grad():
    for module in router_modules(model).values():
        module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.25)
        module.e_score_correction_bias.copy_(torch.randn(module.e_score_correction_bias.shape, generator=gen) * 0.02)

lines = [line.encode("utf-8") for line in TEXT.read_text().splitlines() if line.strip()]
input_ids = torch.tensor([list(line[:PROMPT_BYTES]) for line in lines[:PROMPTS]], dtype=torch.long)

with HFRouterRecorder(model) as rec, torch.no_grad():
    model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=DECODE_STEPS + 1,
                   min_new_tokens=DECODE_STEPS + 1, do_sample=False)
meta, layers = rec.trace(
    model_name="transformers DeepseekV3ForCausalLM, tiny seeded config (256 experts, top-8)",
    provenance=(
        f"HF transformers DeepseekV3ForCausalLM from a small config, weights seeded ({SEED}), router weights "
        f"std 0.25 and e_score_correction_bias N(0, 0.02^2); input {PROMPTS} prompts x {PROMPT_BYTES} UTF-8 bytes "
        f"of {TEXT.name}; 1 prefill step + {DECODE_STEPS} greedy decode steps; router logits and the model's own "
        "topk ids/weights recorded by routetool.capture.hf hooks; made by traces/make_deepseek_v3_hf.py"
    ),
)
write_trace(OUT, meta, layers, force="--force" in sys.argv)
print(f"wrote {OUT}: {rec.num_steps} steps, layers {sorted(layers)}")
