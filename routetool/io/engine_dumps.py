"""Routing outputs the inference and training engines write themselves -> routetool's dump
records (:class:`~routetool.io.dumps.ImportedRouting`, :class:`~routetool.io.dumps.ImportedCounts`).

Each reader follows the engine's own writer (docs/balance.md names the code and the flag):

* ``vllm``: vLLM's routed experts (``--enable-return-routed-experts``; vLLM 0.33
  ``CompletionOutput.routed_experts``, an integer array ``[num_tokens, num_hidden_layers,
  num_experts_per_tok]``, uint8 for at most 256 experts, else uint16; rows of layers no router
  writes, the dense ones, stay 0). On disk: the ``.npy`` ``np.save`` writes of one request, a
  folder of them, or the JSON of the OpenAI-compatible server's responses (``/v1/completions``,
  ``/v1/chat/completions``: ``choices[i].routed_experts``, the base64 of that ``.npy``; one
  response per ``.json`` file, a list of them, or one per line of a ``.jsonl``; a folder of
  them).
* ``sglang-routed``: SGLang's routed experts (``--enable-return-routed-experts`` and the request's
  ``return_routed_experts``): the native ``/generate`` response's ``meta_info.routed_experts``,
  the base64 of the raw int32 bytes of ``[prompt_tokens + completion_tokens - 1,
  num_hidden_layers, num_experts_per_tok]`` (no shape is stored: ``topk`` must be given).
* ``megatron``: Megatron-Core ``RouterReplay`` recordings saved with ``torch.save``, as its
  documentation does (``torch.save(router_replay.get_recorded_indices(), path)``): one MoE
  layer's ``top_k_idx`` ``[num_tokens, topk]``, the list ``RouterReplay.get_recorded_data()``
  returns (one such tensor per MoE layer, in router order), or the stacked
  ``[num_tokens, num_moe_layers, topk]`` of its inference ``RoutingMetadata``. A folder of
  ``.pt`` files is read file by file (natural order), one step each.
* ``megatron-ep-load``: the ``mcore_ep_load_dump_v1`` ``.npz`` of Megatron-Core's
  ``ExpertLoadRecorder`` (``MCORE_MOE_EXPERT_LOAD_DUMP=1``): per rank, ``loads`` int32
  ``[num_local_moe_layers, forwards, num_global_physical_experts]`` tokens per expert of that
  rank's tokens, valid up to ``forward_counts`` per layer; a folder of them (every rank) is
  summed per layer and forward pass. Counts only.
* ``flashinfer-trace``: FlashInfer-Trace MoE workloads, the ``safetensors`` blob its tracer
  writes per captured call (``blob/workloads/moe/<definition>/<definition>_<uuid>.safetensors``)
  holding ``routing_logits`` ``[seq_len, num_experts]`` and ``routing_bias`` ``[num_experts]``.
  These hold logits: they become traces a kernel can route. The definition name, in the file
  name, gives the routing: ``ds_routing`` (sigmoid scores, selection bias) or ``renorm``
  (softmax), ``topk<K>``, ``ng<n_group>``/``kg<topk_group>`` (group-limited selection, carried
  into the trace's router).

Per-request formats (vLLM, SGLang routed experts) become one step per request, labelled with the
request id, with every token's position in its request (``ImportedLayer.positions``).

Hostile input: JSON through :mod:`routetool.io.jsonstrict`; ``.npy`` and ``.npz`` through
:func:`numpy.load` without pickles (``allow_pickle=False``), the sizes an array header declares
checked against the bytes present before anything is allocated; ``.pt`` through
``torch.load(weights_only=True)`` within the size budget (:mod:`routetool.io.limits`);
safetensors headers strictly. Every failure is a one-line :class:`RouteToolError`.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from routetool.errors import RouteToolError, first_line
from routetool.io.jsonstrict import JSONProblem, load_file, loads
from routetool.io.limits import MAX_EXPERTS, MAX_LAYERS, check_expert_tables, input_bytes
from routetool.io.imported import ImportedCounts, ImportedLayer, ImportedRouting, _refuse_counts, _torch_load
from routetool.io.paths import natural_key as _natural_key
from routetool.io.tracefile import RouterConfig

ENGINE_SUFFIXES = (".npy", ".npz", ".safetensors")
"""File suffixes only the engine readers read (besides ``.pt``, ``.json`` and ``.jsonl``)."""

_UNUSED = "(not written by any router: a dense layer)"


# ---------------------------------------------------------------------------------------
# sniffing
def _head(path: Path, n: int = 1 << 20) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(n)
    except OSError:
        return b""


def safetensors_keys(path: Path) -> set[str] | None:
    """The tensor names a safetensors file's header declares (None: no safetensors header)."""
    head = _head(path, 8)
    if len(head) < 8:
        return None
    n = int.from_bytes(head, "little")
    if not 2 <= n <= 100 << 20:
        return None
    data = _head(path, 8 + n)[8:]
    try:
        header = loads(data.decode("utf-8"))
    except (JSONProblem, UnicodeDecodeError):
        return None
    return set(header) - {"__metadata__"} if isinstance(header, dict) else None


def _torch_pickle_head(path: Path) -> bytes:
    """The first 64 KiB of the pickle a ``torch.save`` zip archive holds (empty if none)."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((i.filename for i in archive.infolist() if i.filename.endswith("data.pkl")), None)
            if name is None:
                return b""
            with archive.open(name) as fh:
                return fh.read(1 << 16)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError, NotImplementedError):
        return b""


def sniff(path: Path) -> str | None:
    """The engine format of the file ``path`` by its name and content, or None (another reader's).

    ``.npy`` -> vllm, ``.npz`` -> megatron-ep-load, a ``.safetensors`` holding ``routing_logits``
    -> flashinfer-trace, a ``.pt`` whose pickle holds tensors but no SGLang recorder keys ->
    megatron, JSON whose top level holds ``choices`` (OpenAI-compatible responses) -> vllm, or
    ``meta_info`` (SGLang ``/generate`` responses) -> sglang-routed.
    """
    suffix = path.suffix.lower()
    if suffix == ".npy":
        return "vllm"
    if suffix == ".npz":
        return "megatron-ep-load"
    if suffix == ".safetensors":
        keys = safetensors_keys(path)
        return "flashinfer-trace" if keys is not None and "routing_logits" in keys else None
    if suffix in (".pt", ".pth"):
        head = _torch_pickle_head(path)
        # pickle protocol 2: PROTO (2 bytes), then EMPTY_DICT for SGLang's dict; a tensor or a list of them otherwise
        if head[2:3] not in (b"}", b"") and b"records" not in head and b"logical_count" not in head \
                and b"_rebuild_tensor" in head:
            return "megatron"
        return None
    if suffix in (".json", ".jsonl", ".ndjson", ""):
        text = _head(path, 1 << 16).lstrip()
        if not text[:1] in (b"{", b"["):
            return None
        if re.match(rb'\[?\s*\{\s*"(id|object|created|model|choices)"\s*:', text) and re.search(rb'"choices"\s*:', text):
            return "vllm"
        if re.match(rb'\[?\s*\{\s*"(text|output_ids|meta_info)"\s*:', text) and re.search(rb'"meta_info"\s*:', text):
            return "sglang-routed"
    return None


# ---------------------------------------------------------------------------------------
# shared checks
def _npy_array(data: io.BufferedIOBase | io.BytesIO, size: int, where: str, path: Path) -> np.ndarray:
    """One ``.npy`` image (``np.save``'s bytes) as an array, pickles refused, the declared size
    checked against the ``size`` bytes present before numpy allocates it."""
    try:
        version = np.lib.format.read_magic(data)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(data)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(data)
    except Exception as exc:  # noqa: BLE001 - numpy parses the header with ast/tokenize: any failure is bad input
        raise RouteToolError(f"{where}: not a .npy array ({_first_line(exc)})", path=path,
                             fix="pass the array vLLM returns, saved with np.save") from None
    if dtype.hasobject:
        raise RouteToolError(f"{where}: a .npy array of Python objects (dtype {dtype}), not expert ids", path=path,
                             fix="pass the integer array vLLM returns, saved with np.save")
    declared = math.prod(shape) * dtype.itemsize  # Python integers: a hostile shape cannot overflow
    present = size - data.tell()
    if declared > present:
        raise RouteToolError(f"{where}: the .npy header declares {declared:,} bytes of data ({list(shape)} "
                             f"{dtype}) but {present:,} follow it", path=path,
                             fix="the array is cut short or damaged: save it again")
    data.seek(0)
    try:
        return np.load(data, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - a damaged array of any kind is bad input
        raise RouteToolError(f"{where}: cannot read the .npy array ({_first_line(exc)})", path=path,
                             fix="save it again with np.save") from None


def _first_line(exc: BaseException) -> str:
    return first_line(exc, 100, with_type=False) or type(exc).__name__


_INT64_MAX = (1 << 63) - 1


def _int_ids(a, where: str, path: Path, expected: str) -> torch.Tensor:
    """An integer array (numpy of any byte order and layout, or torch) as int64, or a one-line
    error naming its dtype, or the first id int64 cannot hold (uint64)."""
    if isinstance(a, np.ndarray):
        if a.dtype.kind not in "iu":
            raise RouteToolError(f"{where}: expert ids of dtype {a.dtype}, expected {expected}", path=path,
                                 fix="pass the engine's unmodified output")
        if a.dtype.kind == "u" and a.dtype.itemsize == 8 and a.size and int(a.max()) > _INT64_MAX:
            raise RouteToolError(f"{where}: expert id {int(a.max())} is out of range (at most {MAX_EXPERTS - 1:,})",
                                 path=path, fix="pass the engine's unmodified output")
        a = np.ascontiguousarray(a, dtype=np.int64)  # native byte order, C order
    t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
    if not isinstance(t, torch.Tensor) or t.dtype in (torch.bool, torch.complex64, torch.complex128) \
            or t.is_floating_point() or t.is_complex():
        shown = getattr(t, "dtype", type(t).__name__)
        raise RouteToolError(f"{where}: expert ids of dtype {shown}, expected {expected}", path=path,
                             fix="pass the engine's unmodified output")
    return t.long()


@dataclass
class _Part:
    """One step's expert ids: ``ids`` ``[T, L, K]`` (layers on axis 1), a label and where it came from."""

    ids: torch.Tensor
    label: str
    where: str
    start: int = 0  # the position of its first token in its request


def _check_rows(ids: torch.Tensor, E: int, where: str, layer: int, path: Path) -> None:
    """Every row of ``ids`` ``[T, K]`` picks K distinct experts in ``[0, E)``: else one line naming the first bad row."""
    if ids.numel() == 0:
        return
    negative = ids < 0
    bad = negative | (ids >= E)
    srt = ids.sort(dim=1).values
    dup = torch.zeros_like(bad)
    dup[:, 1:] = srt[:, 1:] == srt[:, :-1]
    rows = (bad.any(1) | dup.any(1)).nonzero()
    if rows.numel():
        t = int(rows[0])
        row = ids[t].tolist()
        why = "a negative id" if bool(negative[t].any()) else f"an id outside [0, {E})" if bool(bad[t].any()) \
            else "one expert twice"
        raise RouteToolError(f"{where}: layer {layer}, token {t}: the ids {row} hold {why}; "
                             f"{rows.numel()} row(s) of the layer are invalid", path=path,
                             fix="each token picks distinct experts in [0, num_experts): pass the engine's unmodified "
                                 "output, or the model's --num-experts")


def _assemble_parts(path: Path, fmt: str, parts: list[_Part], options, model: str, notes: list[str],
                    files: list[Path], layer_ids: list[int] | None = None):
    """Steps of ``[T, L, K]`` ids -> :class:`ImportedRouting` (one step per part, layers on axis 1).

    A layer that is zero in every row of every part was never written by a router (vLLM and SGLang
    keep a row for every hidden layer, dense ones included) and is left out, with a note."""

    parts = [p for p in parts if p.ids.shape[0] > 0]
    if not parts:
        raise RouteToolError("holds no token rows", path=path, fix="capture some requests first")
    L, K = parts[0].ids.shape[1:]
    for p in parts:
        if tuple(p.ids.shape[1:]) != (L, K):
            raise RouteToolError(f"{p.where}: ids of shape {list(p.ids.shape)}, where {parts[0].where} has "
                                 f"[tokens, {L}, {K}]", path=path, fix="read the outputs of one model at a time")
    if L == 0 or K == 0:
        raise RouteToolError(f"{parts[0].where}: ids of shape {list(parts[0].ids.shape)} hold no expert ids",
                             path=path, fix="pass the engine's unmodified output")
    if L > MAX_LAYERS or K > MAX_EXPERTS:
        raise RouteToolError(f"{parts[0].where}: ids of shape {list(parts[0].ids.shape)}: more layers or experts "
                             "than routetool reads", path=path, fix="pass the engine's unmodified output")
    if options.topk is not None and options.topk != K:
        raise RouteToolError(f"{parts[0].where}: the ids hold topk={K} experts per token, --topk says {options.topk}",
                             path=path, fix="drop --topk, or pass the file of the right model")
    names = layer_ids if layer_ids is not None else list(range(L))
    used = [l for l in range(L) if any(bool(p.ids[:, l].any()) for p in parts)]
    if not used:
        raise RouteToolError("every expert id is 0 in every layer: no router wrote these rows", path=path,
                             fix="capture with the engine's routed-experts option on a MoE model")
    if len(used) < L:
        dense = [names[l] for l in range(L) if l not in used]
        shown = ", ".join(map(str, dense[:12])) + (" ..." if len(dense) > 12 else "")
        notes.append(f"layer(s) {shown} left out: every id 0 in every token {_UNUSED}")
    max_id = max(int(p.ids[:, used].max()) for p in parts)
    for l in used:  # a negative id first: the largest id, which E is inferred from, means nothing beside it
        for p in parts:
            if bool((p.ids[:, l] < 0).any()):
                _check_rows(p.ids[:, l], max_id + 1, p.where, names[l], path)
    E = options.num_experts
    if E is None:
        E = max_id + 1
        if E > MAX_EXPERTS:
            raise RouteToolError(f"expert id {max_id} is out of range (at most {MAX_EXPERTS - 1:,})", path=path,
                                 fix="pass the engine's unmodified output")
        notes.append(f"num_experts={E} inferred from the largest id ({max_id}); pass --num-experts if the model "
                     "has more (an expert never picked would be missed)")
    if K > E:
        raise RouteToolError(f"topk={K} > num_experts={E}", path=path, fix="pass the model's --num-experts")
    check_expert_tables(path, experts=E, layer_steps=len(parts) * len(used), layers=len(used),
                        size=input_bytes(files),
                        fix="pass the model's --num-experts" if options.num_experts else
                            f"the largest expert id, {max_id}, sets num_experts: pass the model's --num-experts")
    sizes = [p.ids.shape[0] for p in parts]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    positions = torch.cat([torch.arange(p.start, p.start + p.ids.shape[0], dtype=torch.int64) for p in parts])
    layers = {}
    for l in used:
        for p in parts:
            _check_rows(p.ids[:, l], E, p.where, names[l], path)
        ids = torch.cat([p.ids[:, l] for p in parts]).to(torch.int32)
        layers[names[l]] = ImportedLayer(topk_ids=ids, topk_weights=None, step_offsets=list(offsets),
                                         positions=positions)
    rows = sum(sizes) * len(used)
    result = ImportedRouting(source=str(path), format=fmt, model=options.model or model, num_experts=E, topk=K,
                             layers=layers, notes=notes, step_labels=[p.label for p in parts])
    result.rows_read = rows
    return result


def _b64(text, where: str, key: str, path: Path) -> bytes:
    if not isinstance(text, str) or not text:
        raise RouteToolError(f"{where}: {key} is {type(text).__name__}, not a base64 string", path=path,
                             fix="start the engine with --enable-return-routed-experts and keep the response as it "
                                 "came")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RouteToolError(f"{where}: {key} is not base64 ({_first_line(exc)})", path=path,
                             fix="keep the response as the server sent it") from None


def _json_documents(path: Path, files: list[Path]) -> list[tuple[str, object]]:
    """(where, response) for every response in ``files``: a ``.json`` holds one response or a list
    of them, a ``.jsonl`` one per line."""
    out = []
    for f in files:
        name = f.name if f != path else ""
        if f.suffix.lower() in (".jsonl", ".ndjson"):
            with open(f, "rb") as fh:
                for lineno, raw in enumerate(fh, 1):
                    where = f"{name + ' ' if name else ''}line {lineno}"
                    try:
                        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8").strip()
                    except UnicodeDecodeError:
                        raise RouteToolError(f"{where}: not UTF-8 text", path=path,
                                             fix="keep the responses as the server sent them") from None
                    if not line:
                        continue
                    try:
                        out.append((where, loads(line)))
                    except JSONProblem as exc:
                        raise exc.error(path, where=where, fix="one JSON response per line") from None
        else:
            doc = load_file(f, fix="pass the JSON the server returned")
            docs = doc if isinstance(doc, list) else [doc]
            for i, d in enumerate(docs):
                where = (name or "") + (f"[{i}]" if isinstance(doc, list) else "")
                out.append((where or "response", d))
    return out


def _files(path: Path, suffixes: tuple[str, ...]) -> list[Path]:

    if path.is_dir():
        files = sorted((p for p in path.iterdir() if p.suffix.lower() in suffixes and not p.name.startswith(".")),
                       key=_natural_key)
        if not files:
            raise RouteToolError(f"the folder holds no {'/'.join(suffixes)} files", path=path,
                                 fix="point at the engine's output files")
        return files
    return [path]


# ---------------------------------------------------------------------------------------
# vLLM
def read_vllm(path: Path, options):
    """vLLM's routed experts: ``.npy`` files (one request each, or a folder of them) or the JSON
    (lines) of its OpenAI-compatible responses. See the module docstring."""
    npy = path.suffix.lower() == ".npy" or path.is_dir() and any(
        p.suffix.lower() == ".npy" and not p.name.startswith(".") for p in path.iterdir())
    files = _files(path, (".npy",)) if npy else _files(path, (".json", ".jsonl", ".ndjson"))  # (a folder: its
    # .npy arrays, else its JSON responses)
    parts: list[_Part] = []
    notes: list[str] = []
    model = path.stem
    if files[0].suffix.lower() == ".npy":
        for f in files:
            where = f.name if f != path else "array"
            with open(f, "rb") as fh:
                size = f.stat().st_size
                a = _npy_array(fh, size, where, path)
            parts.append(_Part(_vllm_ids(a, where, path), f.stem, where))
        notes.append("one step per request (.npy file); token positions from 0 (a request made with "
                     "routed_experts_prompt_start skips that many prompt tokens)")
    else:
        missing = 0
        for where, doc in _json_documents(path, files):
            if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list):
                raise RouteToolError(f"{where}: not an OpenAI-compatible completion response (no 'choices' list)",
                                     path=path, fix="pass the JSON vLLM's /v1/completions or /v1/chat/completions "
                                                    "returned")
            model = str(doc.get("model") or model)
            for i, choice in enumerate(doc["choices"]):
                cw = f"{where} choices[{i}]".strip()
                if not isinstance(choice, dict):
                    raise RouteToolError(f"{cw}: not an object", path=path, fix="pass the response as it came")
                if choice.get("routed_experts") is None:
                    missing += 1
                    continue
                raw = _b64(choice["routed_experts"], cw, "routed_experts", path)
                a = _npy_array(io.BytesIO(raw), len(raw), f"{cw} routed_experts", path)
                label = f"{doc.get('id', where)}/{choice.get('index', i)}"
                parts.append(_Part(_vllm_ids(a, f"{cw} routed_experts", path), label, cw))
        if not parts:
            raise RouteToolError("no response carries routed_experts", path=path,
                                 fix="start vLLM with --enable-return-routed-experts (a response aborted before its "
                                     "first forward pass has none)")
        if missing:
            notes.append(f"{missing} choice(s) without routed_experts skipped (aborted, or the option was off)")
        notes.append("one step per request (choice); token positions from 0 (a request made with "
                     "routed_experts_prompt_start skips that many prompt tokens)")
    return _assemble_parts(path, "vllm", parts, options, model, notes, files)


def _vllm_ids(a: np.ndarray, where: str, path: Path) -> torch.Tensor:
    if a.ndim != 3:
        raise RouteToolError(f"{where}: an array of shape {list(a.shape)}, expected [num_tokens, num_layers, topk]",
                             path=path, fix="pass the routed_experts array of one request")
    return _int_ids(a, where, path, "integers (uint8, uint16 or int32)")


# ---------------------------------------------------------------------------------------
# SGLang routed experts
def read_sglang_routed(path: Path, options):
    """SGLang ``/generate`` responses with ``meta_info.routed_experts`` (see the module docstring)."""
    files = _files(path, (".json", ".jsonl", ".ndjson"))
    K = options.topk
    if K is None:
        raise RouteToolError("SGLang's routed_experts is a flat base64 array: its topk is not recorded", path=path,
                             fix="pass the model's --topk (num_experts_per_tok)")
    parts: list[_Part] = []
    notes: list[str] = ["one step per request; token positions from 0"]
    missing = 0
    for where, doc in _json_documents(path, files):
        meta = doc.get("meta_info") if isinstance(doc, dict) else None
        if not isinstance(meta, dict):
            raise RouteToolError(f"{where}: not an SGLang /generate response (no 'meta_info' object)", path=path,
                                 fix="pass the JSON SGLang's /generate returned")
        if meta.get("routed_experts") is None:
            missing += 1
            continue
        raw = _b64(meta["routed_experts"], where, "meta_info.routed_experts", path)
        if len(raw) % 4:
            raise RouteToolError(f"{where}: meta_info.routed_experts holds {len(raw)} bytes, not int32 values",
                                 path=path, fix="keep the response as the server sent it")
        n = len(raw) // 4
        tokens = [meta.get(k) for k in ("prompt_tokens", "completion_tokens")]
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens):
            raise RouteToolError(f"{where}: meta_info lacks integer prompt_tokens and completion_tokens, which give "
                                 "the number of routed tokens", path=path, fix="keep the response as it came")
        T = max(sum(tokens) - 1, 0)
        if T == 0 or n % (T * K):
            raise RouteToolError(f"{where}: {n:,} expert ids do not split into {T:,} tokens "
                                 f"(prompt_tokens + completion_tokens - 1) x layers x topk={K}", path=path,
                                 fix="pass the model's --topk (num_experts_per_tok)")
        a = np.frombuffer(raw, dtype="<i4").reshape(T, n // (T * K), K)
        label = str(meta.get("id", where))
        parts.append(_Part(_int_ids(a.copy(), where, path, "int32"), label, where))
    if not parts:
        raise RouteToolError("no response carries meta_info.routed_experts", path=path,
                             fix="start SGLang with --enable-return-routed-experts and send return_routed_experts: "
                                 "true")
    if missing:
        notes.append(f"{missing} response(s) without routed_experts skipped")
    return _assemble_parts(path, "sglang-routed", parts, options, path.stem, notes, files)


# ---------------------------------------------------------------------------------------
# Megatron RouterReplay
def read_megatron(path: Path, options):
    """Megatron-Core ``RouterReplay`` recordings (``.pt``; see the module docstring)."""

    files = _files(path, (".pt", ".pth"))
    parts: list[_Part] = []
    for f in files:
        where = f.name if f != path else "file"
        obj = _torch_load(f, fix="pass a RouterReplay recording saved with torch.save")
        parts.append(_Part(_megatron_ids(obj, where, path), f.stem, where))
    notes = [f"{'one step per file; ' if len(files) > 1 else 'one step; '}layers are the MoE layers in router order "
             "(0 = the first MoE layer)"]
    return _assemble_parts(path, "megatron", parts, options, path.stem, notes, files)


def _megatron_ids(obj, where: str, path: Path) -> torch.Tensor:
    expected = ("a top_k_idx tensor [tokens, topk], a list of them (one per MoE layer), or [tokens, layers, topk]")
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 2:
            return _int_ids(obj, where, path, "integers")[:, None, :]
        if obj.dim() == 3:
            return _int_ids(obj, where, path, "integers")
        raise RouteToolError(f"{where}: a tensor of shape {list(obj.shape)}; expected {expected}", path=path,
                             fix="save RouterReplay's recorded indices as they are")
    if isinstance(obj, (list, tuple)) and obj:
        layers = []
        for i, t in enumerate(obj):
            if t is None:
                raise RouteToolError(f"{where}: layer {i} recorded nothing (None)", path=path,
                                     fix="record with RouterReplayAction.RECORD set on every router")
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                shown = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise RouteToolError(f"{where}: item {i} is {shown}; expected {expected}", path=path,
                                     fix="save RouterReplay.get_recorded_data() as it is")
            layers.append(_int_ids(t, f"{where} item {i}", path, "integers"))
        if len({tuple(t.shape) for t in layers}) > 1:
            raise RouteToolError(f"{where}: the layers' indices differ in shape "
                                 f"({sorted({tuple(t.shape) for t in layers})})", path=path,
                                 fix="save the indices of one micro-batch per file")
        return torch.stack(layers, dim=1)
    raise RouteToolError(f"{where}: holds {type(obj).__name__}; expected {expected}", path=path,
                         fix="save RouterReplay's recorded indices with torch.save")


# ---------------------------------------------------------------------------------------
# Megatron expert-load dumps
_NPZ_VERSION = "mcore_ep_load_dump_v1"
_NPZ_KEYS = ("dump_version", "loads", "layer_numbers", "forward_counts", "num_global_physical_experts", "global_rank")


def _npz(f: Path, where: str, path: Path) -> dict[str, np.ndarray]:
    try:
        archive = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError) as exc:
        raise RouteToolError(f"{where}: not a .npz archive ({_first_line(exc)})", path=path,
                             fix=f"pass the {_NPZ_VERSION} .npz Megatron's ExpertLoadRecorder writes") from None
    out = {}
    with archive:
        for info in archive.infolist():
            name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            if info.compress_type != zipfile.ZIP_STORED and info.file_size > 64 * max(info.compress_size, 1):
                raise RouteToolError(f"{where}: {name} declares {info.file_size:,} bytes from {info.compress_size:,}",
                                     path=path, fix="pass the recorder's unmodified dump")
            with archive.open(info) as fh:
                data = io.BytesIO(fh.read(info.file_size + 1))
            out[name] = _npy_array(data, info.file_size, f"{where} {name}", path)
    return out


def read_megatron_ep_load(path: Path, options):
    """Megatron-Core ``mcore_ep_load_dump_v1`` ``.npz`` dumps of per-expert loads (see the module docstring)."""

    files = _files(path, (".npz",))
    dumps = []
    for f in files:
        where = f.name if f != path else "dump"
        d = _npz(f, where, path)
        missing = [k for k in _NPZ_KEYS if k not in d]
        version = str(d["dump_version"]) if "dump_version" in d and d["dump_version"].dtype.kind == "U" else None
        if version != _NPZ_VERSION or missing:
            what = f"dump_version {version!r}" if version != _NPZ_VERSION else f"no {', '.join(missing)}"
            raise RouteToolError(f"{where}: {what}; routetool reads {_NPZ_VERSION} (Megatron-Core's ExpertLoadRecorder: "
                                 f"{', '.join(_NPZ_KEYS)})", path=path,
                                 fix=f"pass an unmodified {_NPZ_VERSION} dump")
        for key in _NPZ_KEYS[1:]:  # every member read is integers; two of them one integer each
            if d[key].dtype.kind not in "iu":
                raise RouteToolError(f"{where}: {key} of dtype {d[key].dtype}, expected integers", path=path,
                                     fix=f"pass an unmodified {_NPZ_VERSION} dump")
            if key in ("num_global_physical_experts", "global_rank") and d[key].size != 1:
                raise RouteToolError(f"{where}: {key} of shape {list(d[key].shape)}, expected one integer", path=path,
                                     fix=f"pass an unmodified {_NPZ_VERSION} dump")
        dumps.append((where, d))
    _refuse_counts(path, options)
    layers_of: dict[int, torch.Tensor] = {}
    ranks: dict[int, str] = {}
    P = None
    for where, d in dumps:
        loads_ = d["loads"]
        numbers, counts = d["layer_numbers"].reshape(-1), d["forward_counts"].reshape(-1)
        p = int(d["num_global_physical_experts"].reshape(-1)[0])
        rank = int(d["global_rank"].reshape(-1)[0])
        if loads_.ndim != 3 or loads_.dtype.kind not in "iu" or loads_.shape[0] != numbers.size \
                or counts.size != numbers.size or loads_.shape[2] != p or not 1 <= p <= MAX_EXPERTS:
            raise RouteToolError(f"{where}: loads {list(loads_.shape)} {loads_.dtype} does not match "
                                 f"{numbers.size} layer_numbers and num_global_physical_experts={p} (expected int32 "
                                 "[layers, forwards, experts])", path=path, fix="pass an unmodified dump")
        if P is not None and p != P:
            raise RouteToolError(f"{where}: {p} physical experts, where {dumps[0][0]} has {P}", path=path,
                                 fix="read the dumps of one run together")
        P = p
        if rank in ranks:
            raise RouteToolError(f"{where}: global_rank {rank} again (also {ranks[rank]})", path=path,
                                 fix="read each rank's dump once (a _partial dump and its full one are the same rank)")
        ranks[rank] = where
        if (counts < 0).any() or (counts > loads_.shape[1]).any() or (numbers < 0).any() \
                or (numbers >= MAX_LAYERS).any() or len(set(numbers.tolist())) != numbers.size:
            raise RouteToolError(f"{where}: forward_counts {counts.tolist()[:8]} or layer_numbers "
                                 f"{numbers.tolist()[:8]} out of range", path=path, fix="pass an unmodified dump")
        for slot, (layer, n) in enumerate(zip(numbers.tolist(), counts.tolist())):
            c = torch.from_numpy(np.ascontiguousarray(loads_[slot, :n])).long()
            if (c < 0).any():
                f_, e = (c < 0).nonzero()[0].tolist()
                raise RouteToolError(f"{where}: loads[{slot}, {f_}, {e}] is {int(c[f_, e])}: counts cannot be negative",
                                     path=path, fix="pass an unmodified dump")
            prev = layers_of.get(layer)
            if prev is None:
                layers_of[layer] = c
            else:
                n_max = max(prev.shape[0], c.shape[0])
                s = torch.zeros(n_max, P, dtype=torch.int64)
                s[: prev.shape[0]] += prev
                s[: c.shape[0]] += c
                layers_of[layer] = s
    if options.num_experts is not None and options.num_experts != P:
        raise RouteToolError(f"the dumps count {P} physical experts, --num-experts says {options.num_experts}",
                             path=path, fix="drop --num-experts")
    layers = {k: v for k, v in sorted(layers_of.items()) if v.shape[0] and bool(v.any())}
    if not layers:
        raise RouteToolError("no layer has a forward pass with routed tokens", path=path,
                             fix="capture with MCORE_MOE_EXPERT_LOAD_DUMP_MAX_FORWARDS > 0 on a MoE model")
    notes = [f"Megatron expert loads of {len(dumps)} rank(s), summed per layer and forward pass (one step each); "
             "layers are Megatron layer_numbers (1-based); experts are physical experts (no map is dumped)"]
    check_expert_tables(path, experts=P, layer_steps=sum(v.shape[0] for v in layers.values()), layers=len(layers),
                        size=input_bytes(files), fix="pass an unmodified dump")
    return ImportedCounts(source=str(path), format="megatron-ep-load", model=options.model or path.stem,
                          num_experts=P, topk=options.topk, layers=layers, notes=notes)


# ---------------------------------------------------------------------------------------
# FlashInfer-Trace MoE workloads
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def flashinfer_router(name: str, topk: int | None, num_experts: int, path: Path) -> tuple[RouterConfig, list[str]]:
    """The router a FlashInfer-Trace MoE definition name describes (``..._ds_routing_topk8_ng1_kg1_e384_...``).

    Raises:
        RouteToolError: no ``ds_routing``/``renorm`` or no ``topk`` in the name (and no ``topk``
            given), or an impossible router (e.g. ``ng`` that does not divide the experts).
    """
    notes = []
    if "ds_routing" in name:
        scoring = "sigmoid"
    elif "renorm" in name:
        scoring = "softmax"
    else:
        raise RouteToolError("the file name names no FlashInfer-Trace MoE routing (ds_routing or renorm)", path=path,
                             fix="keep the name the tracer gave it: <definition>_<uuid>.safetensors")
    m = re.search(r"topk(\d+)", name)
    k = int(m.group(1)) if m else None
    if topk is not None and k is not None and topk != k:
        raise RouteToolError(f"the definition says topk={k}, --topk says {topk}", path=path, fix="drop --topk")
    k = topk or k
    if k is None:
        raise RouteToolError("the file name gives no topk<K>", path=path, fix="pass the model's --topk")
    ng, kg = (re.search(rf"{p}(\d+)", name) for p in ("_ng", "_kg"))
    ng, kg = (int(ng.group(1)) if ng else 1), (int(kg.group(1)) if kg else 1)
    if not 1 <= k <= num_experts:
        raise RouteToolError(f"topk={k} is not in [1, {num_experts}]", path=path, fix="pass the model's --topk")
    groups = dict(zip(RouterConfig.GROUPING, (ng, kg))) if ng > 1 and kg < ng else {}  # (all kept: plain top-k)
    router = RouterConfig(num_experts=num_experts, topk=k, router_score_normalization=scoring, **groups)
    problems = router.problems()
    if problems:
        raise RouteToolError(f"the definition's router is impossible: {'; '.join(problems)}", path=path,
                             fix="keep the name the tracer gave it: <definition>_<uuid>.safetensors")
    notes.append(f"FlashInfer-Trace routing: {scoring} scores, topk={k}"
                 f"{f', n_group={ng}, topk_group={kg}' if groups else ''}; routed_scaling_factor is a scalar of the "
                 "workload, not in the blob: route_scale 1.0 is a placeholder (it scales weights, not ids)")
    return router, notes


def read_flashinfer(path: Path, options):
    """FlashInfer-Trace MoE workload blobs (safetensors; see the module docstring): a trace with logits,
    layer 0, one step per file."""
    from safetensors import safe_open
    from safetensors import SafetensorError


    files = _files(path, (".safetensors",))
    logits, biases, names = [], [], set()
    for f in files:
        where = f.name if f != path else "workload"
        keys = safetensors_keys(f)
        if keys is None or "routing_logits" not in keys:
            raise RouteToolError(f"{where}: no routing_logits tensor; routetool reads FlashInfer-Trace MoE workloads "
                                 "(routing_logits [seq_len, num_experts], routing_bias [num_experts])", path=path,
                                 fix="pass a MoE workload blob of the FlashInfer-Trace tracer")
        try:
            with safe_open(str(f), framework="pt") as st:
                lg = st.get_tensor("routing_logits")
                bias = st.get_tensor("routing_bias") if "routing_bias" in keys else None
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise RouteToolError(f"{where}: cannot read ({_first_line(exc)})", path=path,
                                 fix="pass an unmodified workload blob") from None
        if lg.dim() != 2 or lg.dtype not in _FLOAT or not 1 <= lg.shape[1] <= MAX_EXPERTS:
            raise RouteToolError(f"{where}: routing_logits is {list(lg.shape)} {lg.dtype}; expected [seq_len, "
                                 "num_experts] float32, bfloat16 or float16", path=path, fix="pass an unmodified blob")
        if lg.shape[0] == 0:
            raise RouteToolError(f"{where}: routing_logits holds no rows ({list(lg.shape)})", path=path,
                                 fix="pass a workload of a call that routed tokens" + (
                                     f", or move {f.name} out of the folder" if f != path else ""))
        E = lg.shape[1]
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != E or bias.dtype not in _FLOAT):
            raise RouteToolError(f"{where}: routing_bias is {list(bias.shape)} {bias.dtype}; expected [{E}] float",
                                 path=path, fix="pass an unmodified blob")
        if bias is not None and not bool(torch.isfinite(bias.float()).all()):
            raise RouteToolError(f"{where}: routing_bias holds a non-finite value", path=path,
                                 fix="pass an unmodified blob")
        if logits and E != logits[0].shape[1]:
            raise RouteToolError(f"{where}: {E} experts, where {files[0].name} has {logits[0].shape[1]}", path=path,
                                 fix="read the workloads of one definition at a time")
        if biases and (bias is None) != (biases[0] is None) or (bias is not None and biases
                                                               and not torch.equal(bias.float(), biases[0].float())):
            raise RouteToolError(f"{where}: routing_bias differs from {files[0].name}'s: the workloads come from "
                                 "different MoE layers (each layer has its own bias, and a workload does not say "
                                 "which layer it is)", path=path,
                                 fix="name one workload file, or a folder of workloads that share one routing_bias")
        logits.append(lg)
        biases.append(bias)
        names.add(re.sub(r"_[0-9a-f]{8}-[0-9a-f-]{27}$", "", f.stem))
    if len(names) > 1:
        raise RouteToolError(f"workloads of several definitions ({', '.join(sorted(names)[:3])})", path=path,
                             fix="read the workloads of one definition at a time")
    definition = names.pop()
    E = logits[0].shape[1]
    if options.num_experts is not None and options.num_experts != E:
        raise RouteToolError(f"routing_logits has {E} experts, --num-experts says {options.num_experts}", path=path,
                             fix="drop --num-experts")
    router, notes = flashinfer_router(definition, options.topk, E, path)
    offsets = [0]
    for lg in logits:
        offsets.append(offsets[-1] + lg.shape[0])
    dtype = logits[0].dtype if all(lg.dtype == logits[0].dtype for lg in logits) else torch.float32
    layer = ImportedLayer(topk_ids=None, topk_weights=None, step_offsets=offsets,
                          gating_output=torch.cat([lg.to(dtype) for lg in logits]),
                          bias=biases[0].float() if biases[0] is not None else None)
    if biases[0] is None:
        notes.append("no routing_bias: no selection bias")
    notes.insert(0, f"definition {definition}; {len(files)} workload(s), one step each")
    result = ImportedRouting(source=str(path), format="flashinfer-trace", model=options.model or definition,
                             num_experts=E, topk=router.topk, layers={0: layer}, notes=notes,
                             step_labels=[f.stem for f in files], router=router)
    result.rows_read = offsets[-1]
    return result
