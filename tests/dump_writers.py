"""Writers of the files the engines write themselves, for the importer tests.

Each one writes what the engine's own writer writes (keys, dtypes, shapes, encodings), read from
the engines' code (docs/balance.md names it); the code here is routetool's own:

* vLLM 0.33 (``--enable-return-routed-experts``): ``CompletionOutput.routed_experts``, an array
  ``[num_tokens, num_hidden_layers, topk]`` (uint8 for at most 256 experts, else uint16; dense
  layers' rows stay 0); the OpenAI-compatible server puts ``numpy2base64`` of it (the base64 of
  ``np.save``'s ``.npy`` bytes, pickles off) into ``choices[i].routed_experts``.
* SGLang ``/generate`` with ``return_routed_experts``: ``meta_info.routed_experts``, the base64 of
  the raw int32 bytes of ``[prompt_tokens + completion_tokens - 1, num_hidden_layers, topk]``.
* SGLang's expert-distribution recorder (``dump_record``): ``per_token`` and ``per_pass`` write
  ``{"records": [...], "last_physical_to_logical_map": [layers, physical]}``, ``stat``
  ``{"rank", "logical_count": [buffer steps, layers, experts], "average_utilization_rate_over_window"}``.
* Megatron-Core ``RouterReplay``: ``torch.save`` of ``top_k_idx`` (int64 ``[tokens, topk]``), of
  ``RouterReplay.get_recorded_data()`` (a list of them), or of the stacked ``[tokens, layers, topk]``.
* Megatron-Core ``ExpertLoadRecorder``: ``np.savez`` of the ``mcore_ep_load_dump_v1`` keys.
* FlashInfer-Trace: ``safetensors.torch.save_file`` of the MoE workload's dumped inputs, named
  ``<definition>_<uuid>.safetensors``.
"""

from __future__ import annotations

import base64
import io
import json
import uuid
from pathlib import Path

import numpy as np
import torch


def routed_experts(tokens: int, layers: int, topk: int, experts: int, *, dense=(), seed: int = 0) -> np.ndarray:
    """Expert ids ``[tokens, layers, topk]`` as vLLM returns them: distinct per row, the dense
    layers' rows all 0, uint8 for at most 256 experts, else uint16."""
    rng = np.random.default_rng(seed)
    a = np.zeros((tokens, layers, topk), dtype=np.int64)
    for t in range(tokens):
        for layer in range(layers):
            if layer not in dense:
                a[t, layer] = rng.choice(experts, size=topk, replace=False)
    return a.astype(np.uint8 if experts <= 256 else np.uint16)


def npy_base64(a: np.ndarray) -> str:
    """vLLM's ``numpy2base64``: base64 of the ``.npy`` image ``np.save`` writes (no pickles)."""
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return base64.b64encode(buf.getbuffer()).decode("ascii")


def write_vllm_npy(path: Path, a: np.ndarray) -> Path:
    """One request's ``routed_experts`` saved as the engine hands it over (``np.save``)."""
    np.save(path, a, allow_pickle=False)
    return path


def vllm_completion(arrays: list[np.ndarray | None], *, chat: bool = False, request_id: str = "cmpl-1",
                    model: str = "muse/spark-1x") -> dict:
    """An OpenAI-compatible response of vLLM's server (``/v1/completions``, or ``chat``), one
    choice per array (None: a choice aborted before its first forward pass)."""
    choices = []
    for i, a in enumerate(arrays):
        c = {"index": i, "logprobs": None, "finish_reason": "stop", "stop_reason": None, "token_ids": None,
             "routed_experts": None if a is None else npy_base64(a)}
        if chat:
            c["message"] = {"role": "assistant", "content": "ok", "reasoning": None, "tool_calls": []}
        else:
            c.update(text="ok", prompt_logprobs=None, prompt_token_ids=None)
        choices.append(c)
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": 1764633600,
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None}}


def sglang_generate(a: np.ndarray, prompt_tokens: int, request_id: str = "a1b2") -> dict:
    """A ``/generate`` response of SGLang with ``return_routed_experts``: ``a`` int32
    ``[prompt_tokens + completion_tokens - 1, layers, topk]``, raw bytes in base64."""
    completion = a.shape[0] + 1 - prompt_tokens
    return {"text": "ok", "output_ids": list(range(completion)),
            "meta_info": {"id": request_id, "finish_reason": {"type": "length", "length": completion},
                          "prompt_tokens": prompt_tokens, "weight_version": "default", "completion_tokens": completion,
                          "cached_tokens": 0, "e2e_latency": 0.25,
                          "routed_experts": base64.b64encode(a.astype(np.int32).tobytes()).decode("utf-8")}}


def write_json(path: Path, doc) -> Path:
    path.write_text(json.dumps(doc))
    return path


def write_jsonl(path: Path, docs) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def write_sglang_distribution(path: Path, mode: str, physical_ids: torch.Tensor, phys_to_log: torch.Tensor,
                              positions: list[list[int]]) -> Path:
    """SGLang's expert-distribution recorder dump of ``mode`` (per_token, per_pass, stat) for forward
    passes whose ``physical_ids`` are ``[passes, layers, tokens, 8]`` (-1 unused), as
    ``_DetailAccumulator.dump`` / ``_StatAccumulator.dump`` write it."""
    num_layers, num_physical = phys_to_log.shape
    num_logical = int(phys_to_log.max()) + 1

    def physical_count(ids):  # _convert_per_token_to_global_physical_count
        flat = ids.reshape(num_layers, -1)
        mask = flat != -1
        out = torch.zeros(num_layers, num_physical, dtype=torch.int32)
        return out.scatter_add_(1, flat.masked_fill(~mask, 0).long(), mask.int())

    if mode == "stat":  # a buffer of 4 steps: the unfilled slots stay zero
        lc = torch.zeros(len(physical_ids) + 1, num_layers, num_logical, dtype=torch.int32)
        for s, ids in enumerate(physical_ids):
            g = physical_count(ids)
            lc[s].scatter_add_(1, phys_to_log.long(), g)
        torch.save({"rank": 0, "logical_count": lc, "average_utilization_rate_over_window": None}, path)
        return path
    records = []
    for fp, ids in enumerate(physical_ids):
        rec = {"forward_pass_id": fp, "rank": 0, "gatherer_key": "primary"}
        if mode == "per_token":
            n = ids.shape[1]
            rec.update(input_ids=list(range(100, 100 + n)), positions=positions[fp], extend_seq_lens=[n],
                       forward_mode=1, topk_ids_of_layer=ids.to(torch.int32).clone(), misc_objects=[])
        rec["global_physical_count"] = physical_count(ids)
        records.append(rec)
    torch.save({"records": records, "last_physical_to_logical_map": phys_to_log}, path)
    return path


def write_megatron_replay(path: Path, ids: torch.Tensor, form: str) -> Path:
    """``ids`` ``[tokens, layers, topk]`` saved as Megatron users save RouterReplay recordings:
    ``tensor`` (one layer's ``top_k_idx``, layers must be 1), ``list`` (``get_recorded_data()``)
    or ``stacked`` (``RoutingMetadata.get_routing_indices()``)."""
    ids = ids.long()  # torch.topk's indices
    obj = {"tensor": lambda: ids[:, 0].clone(), "list": lambda: [ids[:, i].clone() for i in range(ids.shape[1])],
           "stacked": lambda: ids.to(torch.int32).clone()}[form]()
    torch.save(obj, path)
    return path


def write_mcore_ep_load(path: Path, loads: np.ndarray, layer_numbers, forward_counts, *, global_rank: int = 0,
                        ep_rank: int = 0, ep_size: int = 1) -> Path:
    """``ExpertLoadRecorder``'s ``np.savez`` (``loads`` int32 ``[layers, forwards, experts]``)."""
    np.savez(path, dump_version=np.asarray("mcore_ep_load_dump_v1"),
             capture_id=np.asarray(f"20261201_235900_pid{1000 + global_rank}"),
             loads=loads.astype(np.int32), layer_numbers=np.asarray(layer_numbers, dtype=np.int32),
             forward_counts=np.asarray(forward_counts, dtype=np.int32),
             ep_group_ranks=np.arange(ep_size, dtype=np.int32), ep_rank=np.int32(ep_rank), ep_size=np.int32(ep_size),
             global_rank=np.int32(global_rank), num_global_physical_experts=np.int32(loads.shape[2]),
             num_local_physical_experts=np.int32(loads.shape[2] // ep_size))
    return path


def write_flashinfer_workload(folder: Path, definition: str, logits: torch.Tensor, bias: torch.Tensor | None,
                              seed: int = 0) -> Path:
    """A FlashInfer-Trace MoE workload blob as its tracer saves it
    (``TraceSet.add_workload_blob_tensor``): ``<definition>_<uuid>.safetensors`` holding the
    dumped inputs by name (``routing_logits`` float32, ``routing_bias`` bfloat16, and others)."""
    from safetensors.torch import save_file

    tensors = {"routing_logits": logits.float().contiguous(),
               "hidden_states": torch.zeros(logits.shape[0], 16, dtype=torch.bfloat16)}
    if bias is not None:
        tensors["routing_bias"] = bias.to(torch.bfloat16).contiguous()
    name = uuid.UUID(bytes=np.random.default_rng(seed).bytes(16), version=4)
    path = folder / f"{definition}_{name}.safetensors"
    save_file(tensors, str(path))
    return path
