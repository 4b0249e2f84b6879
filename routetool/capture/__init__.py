"""Ways to make traces from real runs.

* :mod:`routetool.capture.recorder`: record an inference engine's routing call site (vLLM's
  ``fused_musespark1x_routing``, or any function with its signature) into a sharded trace;
* :mod:`routetool.capture.hf`: forward hooks on the router modules of HF transformers MoE
  models (DeepSeek-V3, Kimi-K2, GLM-4.5, Qwen3-MoE, Mixtral), behind ``routetool capture hf``.

Synthetic traces are made by :mod:`routetool.synth` (``routetool synth``).
"""
