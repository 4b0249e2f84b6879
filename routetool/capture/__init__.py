"""Ways to make traces from real runs.

* :mod:`routetool.capture.recorder`: record an inference engine's routing call site (vLLM's
  ``fused_musespark1x_routing``, or any function with its signature) into a sharded trace, also
  under CUDA-graph replay and torch.compile, through the device ring of
  :mod:`routetool.capture.ring` (its kernel: :mod:`routetool.capture.ring_kernel`);
* :mod:`routetool.capture.vllm_plugin`: the vLLM general plugin that starts a recorder in every
  engine and worker process (``ROUTETOOL_CAPTURE_DIR``), one ``rank-<r>/`` trace per process,
  with the ranks of :mod:`routetool.capture.ranks`;
* :mod:`routetool.capture.hf`: forward hooks on the router modules of HF transformers MoE
  models (DeepSeek-V3, Kimi-K2, GLM-4.5, Qwen3-MoE, Mixtral), behind ``routetool capture hf``.

Synthetic traces are made by :mod:`routetool.capture.synth` (``routetool synth``).
"""
