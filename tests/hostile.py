"""A seeded campaign of hostile inputs through the routetool commands, and the promise it checks.

Case ``i`` of seed ``s`` is always the same input and command (``random.Random(f"{s}/{i}")``):
a small valid trace, sharded index or routing dump, mutated by one generator (safetensors
headers and their ``__metadata__``, ids-only traces declaring huge expert counts, sharded-trace
indexes, JSON lines, CSV, counts JSON, SGLang ``.pt`` dumps, what the engines emit (every tenth
case: vLLM and SGLang routed experts, Megatron ``.pt`` and ``.npz``, FlashInfer-Trace blobs), hostile
paths), then given to one
command (``info``, ``info --scan``, ``balance``, ``import``, ``replay``, ``validate``, and for
about one case in seven ``diff`` of it against itself or a valid trace). Each case
runs in this process through click's ``CliRunner`` and must keep the promise of
docs/cli-contract.md:

* exit code 0, 1 or 2, and no traceback (no exception other than ``SystemExit``);
* on exit 2, exactly one line on stderr, ``routetool: error: ...``;
* no input file changed, no file left behind except the output the command was asked for;
* bounded work per case, not per campaign: a case that runs past :data:`CASE_SECONDS` (a
  read that blocks, a runaway loop; the bound is a hang guard generous enough for a machine
  whose CPU is shared, not a speed test) is stopped and reported, and a case that raises this
  process's peak resident size by more than :data:`CASE_RSS_BYTES` fails (an address-space
  limit stops a runaway allocation before it takes the machine).

How fast the campaign runs is a benchmark's question, not a test's: the JSON report gives the
seconds of the whole run and of the slowest cases.

Run by tests/cli/test_hostile_inputs.py; by hand::

    python tests/hostile.py --seed 18 --cases 300           # the campaign, a JSON report on stdout
    python tests/hostile.py --seed 18 --case 41 --keep /tmp/c41   # one case, its files kept
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import zipfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # (no GPU in CI; read when kernels are defined)

import torch  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from routetool.cli import main  # noqa: E402
from routetool.io.sharded import write_index  # noqa: E402
from routetool.io.trace import LayerArrays, RouterConfig, TraceMeta, write_trace  # noqa: E402

CASE_SECONDS = 60
"""Longest a case may run before it is stopped as hanging (the slowest legitimate one, replay under
the Triton interpreter, takes about a second on an idle 2-core machine; the bound leaves room for
a CPU shared with other work)."""
CASE_RSS_BYTES = 1536 << 20
"""How much one case may raise the process's peak resident size."""
ADDRESS_SPACE_HEADROOM = 6 << 30
"""Address space the campaign may take beyond what it holds after start-up (RLIMIT_AS)."""

HOSTILE_TEXT = ["0", "-1", "", " 8", "8 ", "1_0", "\u0663", "nan", "inf", "-inf", "1e400", "2.5", "9" * 5000,
                str(2**20), str(2**20 + 1), str(2**31), str(10**12), "x" * 10000, "\x00", "[" * 1000, "\ud800"]
HOSTILE_INTS = [0, -1, 1, 7, 8, 2**20 - 1, 2**20, 2**31, 2**63, 10**30, int("9" * 200)]


# ---------------------------------------------------------------------------------------------
# the valid inputs every case starts from
def _seed_files(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(18)
    router = RouterConfig(num_experts=8, topk=2, route_scale=2.5)
    meta = TraceMeta(model="hostile", router=router, provenance="tests/hostile.py")
    logits = LayerArrays(gating_output=torch.randn(6, 8, generator=g), bias=torch.randn(8, generator=g) * 0.01,
                         is_padding=torch.tensor([False] * 5 + [True]), step_offsets=torch.tensor([0, 4, 6]),
                         topk_ids=torch.randint(0, 8, (6, 2), generator=g, dtype=torch.int32),
                         topk_weights=torch.rand(6, 2, generator=g))
    copy = LayerArrays(**{k: v.clone() for k, v in vars(logits).items()})
    out = {"trace": write_trace(folder / "t.safetensors", meta, {0: logits, 1: copy})}
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(10)]).to(torch.int32)
    ids_meta = TraceMeta(model="ids", router=RouterConfig(num_experts=16, topk=4), provenance="ids only")
    out["ids"] = write_trace(folder / "ids.safetensors", ids_meta,
                             {0: LayerArrays(topk_ids=ids, step_offsets=torch.tensor([0, 3, 10]))})
    shards = []
    for i in range(2):
        p = write_trace(folder / f"run-{i:05d}.safetensors", meta, {0: logits})
        shards.append({"path": p.name, "size_bytes": p.stat().st_size, "num_steps": 2})
    out["index"] = write_index(folder / "run.json", shards, complete=True, stopped_by="exit")
    lines = [{"type": "meta", "num_experts": 16, "top_k": 2}]
    lines += [{"req_id": i // 4, "token_idx": i % 4, "layer": i % 2, "topk_ids": [i % 16, (i * 7 + 3) % 16],
               "topk_weights": [0.6, 0.4]} for i in range(24)]
    (folder / "d.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out["jsonl"] = folder / "d.jsonl"
    rows = [f'{i % 2},{i // 6},"[{i % 16}, {(i + 5) % 16}, {(i + 9) % 16}]"' for i in range(18)]
    (folder / "d.csv").write_text("Layer ID,Batch Number,Activated Expert IDs\n" + "\n".join(rows) + "\n")
    out["csv"] = folder / "d.csv"
    (folder / "c.json").write_text(json.dumps({"m": {"a": {"0": {str(e): 10 + e for e in range(8)}},
                                                     "b": {"0": {str(e): 20 - e for e in range(8)}}}}))
    out["counts"] = folder / "c.json"
    return out


def _sglang(rng: random.Random, path: Path) -> None:
    """An SGLang dump of one of three modes, some of them amplifying (the campaign's hole 6)."""
    mode = rng.choice(["per_token", "per_token", "per_token", "stride0", "shared", "stat", "stat_expand", "per_pass",
                       "nested", "cycle", "deflated", "bad_map"])
    phys = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    ids = torch.full((2, rng.randint(1, 20), 8), -1, dtype=torch.int32)
    for layer in range(2):
        for t in range(ids.shape[1]):
            ids[layer, t, :2] = torch.randperm(6, generator=g)[:2]
    rec = {"forward_pass_id": 0, "rank": 0, "topk_ids_of_layer": ids}
    if mode == "per_token":
        torch.save({"records": [dict(rec, forward_pass_id=i) for i in range(rng.randint(1, 5))],
                    "last_physical_to_logical_map": phys}, path)
    elif mode == "stride0":
        n = rng.choice([10, 10_000, 20_000_000, 2**31])
        torch.save({"records": [dict(rec, topk_ids_of_layer=torch.tensor([1, 2]).expand(2, n, 2))]}, path)
    elif mode == "shared":
        torch.save({"records": [rec] * rng.choice([2, 1000, 50_000, 10**6])}, path)
    elif mode == "stat":
        torch.save({"logical_count": torch.randint(0, 9, (rng.randint(1, 4), 2, rng.choice([4, 8, 2**20 + 1])))}, path)
    elif mode == "stat_expand":
        n = rng.choice([8, 1000, 10**6])
        torch.save({"logical_count": torch.tensor([1]).expand(n, 4, n)}, path)
    elif mode == "per_pass":
        m = torch.tensor([[0, 1, 2, rng.choice([3, 2**20 - 1, 2**19])]] * 2)
        torch.save({"records": [{"forward_pass_id": i, "rank": 0, "global_physical_count": torch.ones(2, 4)}
                                for i in range(rng.randint(1, 300))], "last_physical_to_logical_map": m}, path)
    elif mode == "nested":
        x: list = [rec]
        for _ in range(rng.choice([3, 70, 200])):  # (pickle itself recurses per level)
            x = [x]
        torch.save({"records": x}, path)
    elif mode == "cycle":
        x = [rec]
        x.append(x)
        torch.save({"records": x}, path)
    elif mode == "deflated":  # a zip of compressed records: a little file that declares a lot
        torch.save({"logical_count": torch.zeros(1, 2, rng.choice([8, 4 << 20]), dtype=torch.int64)}, path)
        packed = path.with_suffix(".zip")
        with zipfile.ZipFile(path) as src, zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                dst.writestr(info.filename, src.read(info))
        packed.replace(path)
    else:
        torch.save({"records": [rec], "last_physical_to_logical_map": torch.tensor([[0, -5, 2**40, 3, 0, 1]] * 2)},
                   path)


def _npy_bytes(a, *, shape=None, descr=None) -> bytes:
    """``np.save``'s bytes of ``a``, its header optionally declaring another ``shape`` or ``descr``."""
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=True)
    data = buf.getvalue()
    if shape is None and descr is None:
        return data
    n = int.from_bytes(data[8:10], "little")
    header = {"descr": descr or np.lib.format.dtype_to_descr(a.dtype), "fortran_order": False,
              "shape": tuple(shape if shape is not None else a.shape)}
    text = repr(header).encode("latin1")
    text += b" " * (n - 1 - len(text)) + b"\n" if len(text) < n else b"\n"
    return data[:8] + len(text).to_bytes(2, "little") + text + data[10 + n:]


def _engine(rng: random.Random, case: Path) -> tuple[Path, list[str]]:
    """What an engine emits (vLLM and SGLang routed experts, Megatron's RouterReplay and expert-load
    dumps, FlashInfer-Trace workloads), valid or changed in one way; the file and extra options."""
    import base64

    import numpy as np

    try:
        from tests import dump_writers as w
    except ImportError:  # (run as a script: tests/ is the path's first entry)
        import dump_writers as w

    kind = rng.choice(["npy", "vllm_json", "sglang_json", "megatron", "npz", "flashinfer"])
    a = w.routed_experts(rng.randint(1, 12), 3, 2, 8, dense=(0,), seed=rng.randrange(2**31))
    how = rng.choice(["valid", "valid", "cut", "flip", "shape", "dtype", "value"])
    if kind in ("npy", "vllm_json"):
        if how == "shape":
            data = _npy_bytes(a, shape=rng.choice([(2**40, 3, 2), (1, 2**20, 2**20), (-1, 3, 2), (3, 2), ()]))
        elif how == "dtype":
            data = _npy_bytes(rng.choice([a.astype(np.float32), np.array([{"x": 1}], dtype=object), a.astype(">u4")]))
        elif how == "value":
            b = a.astype(np.int64)
            b[0, 1] = rng.choice([[1, 1], [-1, 2], [2**40, 1], [65535, 3]])
            data = _npy_bytes(b)
        else:
            data = _npy_bytes(a)
        if kind == "npy":
            path = case / "req.npy"
            path.write_bytes(_damaged(rng, data, how))
            return path, []
        doc = w.vllm_completion([a])
        doc["choices"][0]["routed_experts"] = base64.b64encode(_damaged(rng, data, how)).decode() \
            if how != "value" or rng.random() < 0.5 else rng.choice(HOSTILE_TEXT + [None, 3, [], {}])
        path = case / "resp.json"
        path.write_text(json.dumps(doc))
        return path, []
    if kind == "sglang_json":
        doc = w.sglang_generate(a.astype(np.int32), rng.randint(1, a.shape[0]))
        if how == "value":
            doc["meta_info"][rng.choice(["prompt_tokens", "completion_tokens"])] = rng.choice(HOSTILE_INTS + [None, "3"])
        elif how != "valid":
            raw = base64.b64decode(doc["meta_info"]["routed_experts"])
            doc["meta_info"]["routed_experts"] = base64.b64encode(_damaged(rng, raw, how)).decode()
        path = case / "gen.jsonl"
        path.write_text(json.dumps(doc) + "\n")
        return path, rng.choice([["--topk", "2"], ["--topk", str(rng.choice([1, 3, 2**20]))], []])
    if kind == "megatron":
        ids = torch.from_numpy(a.astype(np.int64))
        obj = {"valid": lambda: [ids[:, i] for i in range(3)], "cut": lambda: ids,
               "flip": lambda: [ids[:, 0]] * rng.choice([2, 1000, 100_000]),
               "shape": lambda: torch.tensor([1, 2]).expand(rng.choice([10, 20_000_000]), 2),
               "dtype": lambda: rng.choice([ids.float(), [ids[:, 0], "x"], [None], ids[None, None]]),
               "value": lambda: ids - rng.choice([1, 2**40])}[how]()
        path = case / "replay.pt"
        torch.save(obj, path)
        return path, []
    if kind == "npz":
        loads = np.random.default_rng(rng.randrange(2**31)).integers(0, 9, (2, 3, 8))
        path = case / "mcore_ep_loads_rank0_x.npz"
        counts = [3, 3] if how != "value" else [rng.choice(HOSTILE_INTS[:6]), 3]
        w.write_mcore_ep_load(path, loads if how != "dtype" else loads.astype(np.float64), [1, 3], counts)
        if how == "shape":
            np.savez_compressed(path, dump_version=np.asarray("mcore_ep_load_dump_v1"),
                                loads=np.zeros((1, rng.choice([8, 4 << 20]), 8), np.int32))
        elif how in ("cut", "flip"):
            path.write_bytes(_damaged(rng, path.read_bytes(), how))
        return path, []
    folder = case / "moe"
    folder.mkdir()
    definition = rng.choice(["moe_fp8_block_scale_ds_routing_topk2_ng1_kg1_e8_h7168_i2048",
                             "moe_fp8_block_scale_renorm_topk2_e8_h2048_i768"])
    logits = torch.randn(rng.randint(1, 6), 8)
    bias = torch.randn(8)
    if how == "value":
        logits[0, rng.randrange(8)] = rng.choice([float("nan"), float("inf"), -float("inf")])
        bias = rng.choice([bias, torch.full((8,), float("nan"))])
    elif how == "shape":
        logits = rng.choice([torch.randn(2, 2**20 + 1), torch.randn(4), torch.randn(2, 1)])
    elif how == "dtype":
        logits = logits.to(rng.choice([torch.int32, torch.float64, torch.bool]))
    path = w.write_flashinfer_workload(folder, definition, logits, bias, seed=rng.randrange(2**31)) \
        if how != "dtype" else _flashinfer_raw(folder, definition, logits)
    if how in ("cut", "flip"):
        path.write_bytes(_damaged(rng, path.read_bytes(), how))
    return (path if rng.random() < 0.5 else folder), []


def _flashinfer_raw(folder: Path, definition: str, logits: torch.Tensor) -> Path:
    from safetensors.torch import save_file

    path = folder / f"{definition}_0f0e0d0c-0b0a-4908-8706-050403020100.safetensors"
    save_file({"routing_logits": logits.contiguous()}, str(path))
    return path


def _damaged(rng: random.Random, data: bytes, how: str) -> bytes:
    """``data`` cut short (``cut``) or with a few bytes changed (``flip``); as is otherwise."""
    if how == "cut":
        return data[: rng.randrange(len(data))]
    if how == "flip":
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    return data


# ---------------------------------------------------------------------------------------------
# mutators
def _split_safetensors(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join_safetensors(header_text: str, body: bytes) -> bytes:
    raw = header_text.encode("utf-8", "surrogatepass")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _mutate_header(rng: random.Random, data: bytes) -> bytes:
    """The safetensors header of a valid trace, changed in one way (hole 7 and the metadata)."""
    header, body = _split_safetensors(data)
    meta = header.setdefault("__metadata__", {})
    tensors = [k for k in header if k != "__metadata__"]
    kind = rng.choice(["mild", "mild", "mild", "meta_value", "meta_drop", "dup_meta", "dup_tensor", "shape", "dtype",
                       "offsets", "rename", "deep", "long_number", "length", "flip", "truncate", "meta_not_string"])
    if kind == "mild":  # a valid trace still, read further: other router parameters, unknown keys, fewer tensors
        key, value = rng.choice([("route_scale", "1.0"), ("topk", "1"), ("topk", "8"), ("router_score_normalization",
                                 "softmax"), ("router_output_multiplier", "0.5"), ("router_score_division_eps", "1e-6"),
                                 ("weights_semantics", "unnormalized"), ("model", "\x1b[31m"), ("extra", "x" * 1000)])
        meta[key] = value
        if rng.random() < 0.5:
            header.pop(rng.choice([k for k in tensors if not k.endswith(("gating_output", "step_offsets"))]), None)
    elif kind == "meta_value":
        meta[rng.choice(["num_experts", "topk", "route_scale", "format", "format_version", "num_layers",
                         "router_score_normalization", "router_output_multiplier", "router_score_division_eps",
                         "weights_semantics"])] = rng.choice(HOSTILE_TEXT)
    elif kind == "meta_drop" and meta:
        meta.pop(rng.choice(sorted(meta)))
    elif kind == "shape":
        entry = header[rng.choice(tensors)]
        entry["shape"] = [rng.choice(HOSTILE_INTS) for _ in range(rng.randint(0, 3))]
    elif kind == "dtype":
        header[rng.choice(tensors)]["dtype"] = rng.choice(["F64", "I64", "BOOL", "F8_E4M3", "U64", "XYZ", ""])
    elif kind == "offsets":
        header[rng.choice(tensors)]["data_offsets"] = [rng.choice(HOSTILE_INTS), rng.choice(HOSTILE_INTS)]
    elif kind == "rename":
        name = rng.choice(tensors)
        new = rng.choice(["layers.00.", "layers.1_0.", "layers.\u0663.", "layers.x.", "layers.99999999999999999999.",
                          "other."]) + name.rsplit(".", 1)[1]
        header[new] = header.pop(name)
    elif kind == "meta_not_string":
        meta["num_experts"] = rng.choice([8, [8], {"a": 1}, None])
    text = json.dumps(header, ensure_ascii=False)
    if kind == "dup_meta":
        key = rng.choice(["route_scale", "num_experts", "topk", "format"])
        text = text.replace('"__metadata__": {', f'"__metadata__": {{"{key}": "{rng.choice(HOSTILE_TEXT[:12])}", ', 1)
    elif kind == "dup_tensor":
        name = rng.choice(tensors)
        text = text[:-1] + f', "{name}": {json.dumps(header[name])}}}'
    elif kind == "deep":
        depth = rng.choice([10, 63, 65, 1000, 100_000])
        text = text[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}"
    elif kind == "long_number":
        text = text[:-1] + ', "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, ' + "9" * rng.choice(
            [30, 101, 5000]) + "]}}"
    out = _join_safetensors(text, body)
    if kind == "length":
        out = struct.pack("<Q", rng.choice([0, 1, len(text) - 1, 2**20, 10**8, 2**63])) + out[8:]
    elif kind == "flip":
        b = bytearray(out)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        out = bytes(b)
    elif kind == "truncate":
        out = out[: rng.randrange(len(out))]
    return out


def _mutate_ids_trace(rng: random.Random, data: bytes) -> bytes:
    """An ids-only trace that declares an implausible router (hole 5)."""
    header, body = _split_safetensors(data)
    header["__metadata__"]["num_experts"] = str(rng.choice([17, 2**16, 2**20, 2**20 + 1, 2**31, 10**12]))
    if rng.random() < 0.5:
        header["__metadata__"]["topk"] = str(rng.choice([4, 5, 2**20]))
    return _join_safetensors(json.dumps(header), body)


def _mutate_index(rng: random.Random, case: Path, index: Path) -> None:
    """A sharded-trace index changed in one way (holes 1-4)."""
    doc = json.loads(index.read_text())
    kind = rng.choice(["dup", "deep", "long_int", "nul", "loop", "dir", "missing", "absolute", "twice", "size",
                       "types", "many"])
    if kind == "nul":
        doc["shards"][0]["path"] = "run-0\x0000.safetensors"
    elif kind == "loop":
        os.symlink("loop-b.safetensors", case / "loop-a.safetensors")
        os.symlink("loop-a.safetensors", case / "loop-b.safetensors")
        doc["shards"][rng.randrange(2)]["path"] = "loop-a.safetensors"
    elif kind == "dir":
        (case / "sub").mkdir()
        doc["shards"][0]["path"] = "sub"
    elif kind == "missing":
        doc["shards"][1]["path"] = "gone.safetensors"
    elif kind == "absolute":
        doc["shards"][0]["path"] = str(case / "run-00000.safetensors")
    elif kind == "twice":
        doc["shards"][1]["path"] = "./" + doc["shards"][0]["path"]
    elif kind == "size":
        doc["shards"][0]["size_bytes"] = rng.choice([-1, 1.5, "12", True, None, 2**70, 0])
    elif kind == "types":
        doc[rng.choice(["version", "complete", "stopped_by", "shards", "format"])] = rng.choice(
            [1, "1", True, "false", None, [], {}, "x" * 1000])
    elif kind == "many":
        doc["shards"] = doc["shards"] * rng.choice([2, 500])
    text = json.dumps(doc, ensure_ascii=False)
    if kind == "dup":
        text = text.replace('{"path": ', '{"path": "x.safetensors", "path": ', 1) if rng.random() < 0.5 \
            else text[:-1] + ', "format": "routetool-trace-index"}'
    elif kind == "deep":
        d = rng.choice([65, 100_000])
        text = text[:-1] + ', "x": ' + "[" * d + "]" * d + "}"
    elif kind == "long_int":
        text = text.replace('"size_bytes": ', '"size_bytes": ' + "9" * rng.choice([25, 5000]), 1)
    index.write_text(text, encoding="utf-8", errors="surrogatepass")


def _mutate_lines(rng: random.Random, text: str, kind_pool=None) -> bytes:
    """A JSON-lines dump with some lines replaced by hostile ones (holes 1, 2, 6)."""
    lines = text.splitlines()
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(lines))
        kind = rng.choice(kind_pool or ["mild", "mild", "big_id", "id_type", "deep", "dup", "long", "weights", "bytes",
                                        "meta", "layer", "empty", "batch"])
        try:
            obj = json.loads(lines[i])
        except ValueError:  # (a line an earlier mutation broke)
            continue
        if not isinstance(obj, dict):
            continue
        if kind == "mild" and "topk_ids" in obj:  # still valid: other ids, layer, request
            obj.update(topk_ids=[rng.randrange(8), 8 + rng.randrange(8)], layer=rng.randrange(3), req_id=rng.randrange(9))
        elif kind == "big_id" and "topk_ids" in obj:
            obj["topk_ids"][0] = rng.choice([16, 1048575, 1048576, 2**31, -1])
        elif kind == "id_type" and "topk_ids" in obj:
            obj["topk_ids"][1] = rng.choice(["3", 1.5, True, None, [1], {"a": 1}])
        elif kind == "weights" and "topk_weights" in obj:
            obj["topk_weights"][0] = rng.choice([float("nan"), float("inf"), -1.0, 1e39, "0.5"])
        elif kind == "meta":
            obj = {"type": "meta", "num_experts": rng.choice(HOSTILE_INTS), "top_k": rng.choice([2, 3, 2**20])}
        elif kind == "layer":
            obj["layer"] = rng.choice([65535, 65536, -1, "0", 2**40])
        elif kind == "batch" and "topk_ids" in obj:
            obj["topk_ids"] = [obj["topk_ids"]] * rng.choice([2, 1000])
        line = json.dumps(obj)
        if kind == "deep":
            d = rng.choice([65, 100_000])
            line = line[:-1] + ', "x": ' + "[" * d + "]" * d + "}"
        elif kind == "dup":
            line = line[:-1] + ', "topk_ids": [1, 2]}'
        elif kind == "long":
            line = line.replace("[", "[" + "9" * rng.choice([30, 101, 5000]) + ", ", 1)
        elif kind == "empty":
            line = rng.choice(["", "{}", "[]", "null", "{", '{"topk_ids": []}'])
        lines[i] = line
    data = ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")
    if rng.random() < 0.1:
        data = data.replace(b"topk", b"\xff\xfe", 1)
    return data


def _mutate_csv(rng: random.Random, text: str) -> bytes:
    lines = text.splitlines()
    i = rng.randrange(1, len(lines))
    layer, batch, ids = lines[i].split(",", 2)
    kind = rng.choice(["big_id", "layer", "brackets", "cell", "nul", "fields"])
    if kind == "big_id":
        ids = f'"[{rng.choice([16, 1048575, 1048576, 10**30])}, 1, 2]"'
    elif kind == "layer":
        layer = rng.choice(["65535", "65536", "-1", "1_0", "\u0663", "9" * 5000, ""])
    elif kind == "brackets":
        ids = rng.choice(['"[1, 2"', '"1, 2]"', '"[[1, 2, 3]]"', '"[' + "[" * 1000 + '1]"', '"()"'])
    elif kind == "cell":
        ids = rng.choice(['"[1, 2.5, 3]"', '"[nan, 1, 2]"', '"[1, 1, 2]"', '"[]"', '"' + "1 " * 100000 + '"'])
    elif kind == "nul":
        ids = '"[1, 2\x00, 3]"'
    else:
        ids += ",extra"
    lines[i] = ",".join([layer, batch, ids])
    return ("\n".join(lines) + "\n").encode()


def _mutate_counts(rng: random.Random) -> bytes:
    kind = rng.choice(["big_expert", "many_tables", "deep", "dup", "long", "values", "mixed"])
    doc: dict = {"m": {"a": {"0": {str(e): 5 for e in range(8)}}}}
    if kind == "big_expert":
        doc["m"]["a"]["0"][str(rng.choice([8, 2**16, 1048575, 1048576]))] = 1
    elif kind == "many_tables":
        doc["m"] = {f"d{i}": {str(layer): {str(rng.choice([7, 2**17])): 1} for layer in range(rng.choice([1, 50]))}
                    for i in range(rng.choice([2, 200]))}
    elif kind == "values":
        doc["m"]["a"]["0"]["1"] = rng.choice([-1, 1.5, float("nan"), "3", 2**62, None, [1]])
    elif kind == "mixed":
        doc["m"]["a"]["1"] = [1, 2, 3]
    text = json.dumps(doc)
    if kind == "deep":
        d = rng.choice([65, 100_000])
        text = text[:-1] + ', "x": ' + "[" * d + "]" * d + "}"
    elif kind == "dup":
        text = text.replace('{"0": 5', '{"0": 1, "0": 5', 1)
    elif kind == "long":
        text = text.replace(": 5", ": " + "9" * rng.choice([25, 5000]), 1)
    return text.encode()


# ---------------------------------------------------------------------------------------------
# a case: files in a folder, and a command
TRACE_COMMANDS = [["info", "IN"], ["info", "IN", "--scan", "--no-progress"], ["balance", "IN", "--no-progress"],
                  ["replay", "IN", "--device", "cpu", "--no-latency", "--no-progress"],
                  ["validate", "IN", "--suite", "none", "--device", "cpu", "--no-progress"]]
DUMP_COMMANDS = [["balance", "IN", "--no-progress"], ["import", "IN", "-o", "OUT"]]


DIFF_SHARE = 1 / 7
"""Share of the cases whose command becomes ``diff`` (chosen by a generator of its own, so that
every case's input stays what it was)."""


def build_case(seed: int, number: int, seeds: dict[str, Path], case: Path) -> list[str]:
    """Write case ``number``'s files into ``case`` and return its command line (``IN``, ``OUT``
    replaced by paths): :func:`_build_case`'s, or for about :data:`DIFF_SHARE` of the cases
    ``routetool diff`` of its input against itself or a valid trace, with the case's output
    options (a hostile output path included)."""
    argv = _build_case(seed, number, seeds, case)
    drng = random.Random(f"{seed}/{number}/diff")
    if drng.random() >= DIFF_SHARE:
        return argv
    inp = argv[1]
    out = [a for i, a in enumerate(argv) if i > 1 and argv[i - 1] in ("--json", "--eplb-out", "-o")]
    keep = [a for i, a in enumerate(argv[2:], 2) if a in ("--force", "--topk") or argv[i - 1] == "--topk"]
    other = drng.choice([inp, str(seeds["trace"]), str(seeds["ids"])])
    pair = [inp, other] if drng.random() < 0.5 else [other, inp]
    command = ["diff", *pair, "--no-progress", *keep]
    if out:
        command += [drng.choice(["--json", "--plot"]), out[0]]
    return command


def _build_case(seed: int, number: int, seeds: dict[str, Path], case: Path) -> list[str]:
    rng = random.Random(f"{seed}/{number}")
    out = case / "out.safetensors"
    if number % 10 == 9:  # what the engines emit (their own generator: the other cases stay as they were)
        erng = random.Random(f"{seed}/{number}/engine")
        inp, extra = _engine(erng, case)
        command = erng.choice(DUMP_COMMANDS) + extra
        return [str(inp) if a == "IN" else str(out) if a == "OUT" else a for a in command]
    target = rng.choice(["header", "header", "ids", "index", "jsonl", "csv", "counts", "sglang", "sglang", "paths"])
    if target in ("header", "ids"):
        src = seeds["trace" if target == "header" else "ids"]
        inp = case / "t.safetensors"
        mutate = _mutate_header if target == "header" else _mutate_ids_trace
        inp.write_bytes(mutate(rng, src.read_bytes()))
        command = rng.choice(TRACE_COMMANDS if target == "header" else TRACE_COMMANDS[:3])
    elif target == "index":
        for p in seeds["index"].parent.glob("run*"):
            shutil.copy(p, case / p.name)
        inp = case / "run.json"
        _mutate_index(rng, case, inp)
        command = rng.choice(TRACE_COMMANDS[:3])
    elif target in ("jsonl", "csv", "counts"):
        inp = case / seeds[target].name
        data = {"jsonl": lambda: _mutate_lines(rng, seeds["jsonl"].read_text()),
                "csv": lambda: _mutate_csv(rng, seeds["csv"].read_text()),
                "counts": lambda: _mutate_counts(rng)}[target]()
        inp.write_bytes(data)
        command = rng.choice(DUMP_COMMANDS if target != "counts" else DUMP_COMMANDS[:1])
    elif target == "sglang":
        inp = case / "dump.pt"
        _sglang(rng, inp)
        command = rng.choice(DUMP_COMMANDS)
    else:
        return _path_case(rng, seeds, case)
    if rng.random() < 0.3 and command[0] != "import":
        command = command + ["--json", "OUT"]
        out = case / "out.json"
    return [str(inp) if a == "IN" else str(out) if a == "OUT" else a for a in command]


def _path_case(rng: random.Random, seeds: dict[str, Path], case: Path) -> list[str]:
    """Hostile paths for an input or an output (holes 3 and 4)."""
    trace = case / "t.safetensors"
    shutil.copy(seeds["trace"], trace)
    os.symlink("b.json", case / "a.json")
    os.symlink("a.json", case / "b.json")
    os.symlink("nowhere.json", case / "dangling.json")
    os.mkfifo(case / "fifo.json")
    (case / "dir.json").mkdir()
    (case / "notes.txt").write_text("keep")
    hostile = [case / "a.json", case / "dangling.json", case / "fifo.json", case / "dir.json", trace,
               case / "notes.txt" / "out.json", case / "a.json" / "out.json", case / ("x" * 300 + ".json")]
    command = rng.choice([["info", "IN", "--json", "OUT"], ["balance", "IN", "--no-progress", "--json", "OUT"],
                          ["balance", "IN", "--no-progress", "--eplb-out", "OUT"], ["info", "BAD"],
                          ["balance", "BAD", "--no-progress"], ["import", "BAD", "-o", "OUT"],
                          ["replay", "IN", "--device", "cpu", "--no-latency", "--no-progress", "--json", "OUT"]])
    bad = str(rng.choice(hostile))
    if rng.random() < 0.5:
        command = command + ["--force"]
    return [str(trace) if a == "IN" else bad if a in ("OUT", "BAD") else a for a in command]


# ---------------------------------------------------------------------------------------------
# running and judging
def _snapshot(folder: Path) -> dict[str, str]:
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root) / name
            if p.is_symlink() or not p.is_file():
                out[str(p)] = "link" if p.is_symlink() else "dir" if p.is_dir() else "special"
            else:
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class CaseTimeout(BaseException):
    """Raised in a case that runs past :data:`CASE_SECONDS` (a BaseException: no ``except
    Exception`` of the code under test catches it)."""


@contextlib.contextmanager
def _case_deadline(seconds: float):
    """Raise :class:`CaseTimeout` in the main thread once ``seconds`` have passed (SIGALRM; a
    blocking read is interrupted too). Without SIGALRM (not POSIX), no deadline."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise CaseTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_case(seed: int, number: int, seeds: dict[str, Path], case: Path) -> dict:
    """Build and run one case; the result says what broke the promise (``problems``)."""
    case.mkdir(parents=True)
    argv = build_case(seed, number, seeds, case)
    # what the command may write: the paths after its output options, never its input
    outputs = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--json", "--eplb-out", "-o", "--plot")} - {argv[1]}
    before = _snapshot(case)
    rss_before = _peak_rss()
    start = time.perf_counter()
    try:
        with _case_deadline(CASE_SECONDS):
            result = CliRunner().invoke(main, argv)
    except CaseTimeout:
        return {"case": number, "argv": [a.replace(str(case), "CASE") for a in argv], "exit_code": None,
                "stderr": "", "seconds": round(time.perf_counter() - start, 3), "rss_added_bytes": 0,
                "problems": [f"still running after {CASE_SECONDS} s: stopped (a read that blocks, a runaway loop?)"]}
    seconds = time.perf_counter() - start
    rss_added = _peak_rss() - rss_before
    after = _snapshot(case)
    problems = []
    if result.exit_code not in (0, 1, 2):
        problems.append(f"exit code {result.exit_code}")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        problems.append(f"traceback: {type(result.exception).__name__}: {str(result.exception)[:200]}")
    if "Traceback (most recent call last)" in result.output:
        problems.append("a traceback on the output")
    lines = result.stderr.strip().splitlines()
    if result.exit_code == 2 and (len(lines) != 1 or not lines[0].startswith("routetool: error: ")):
        problems.append(f"exit 2 with {len(lines)} stderr lines: {result.stderr[:300]!r}")
    changed = sorted(p for p in before if after.get(p) != before[p] and p not in outputs)
    if changed:
        problems.append(f"inputs changed: {changed}")
    new = sorted(p for p in after if p not in before and p not in outputs)
    if new:
        problems.append(f"files left behind: {new}")
    if rss_added > CASE_RSS_BYTES:
        problems.append(f"raised the peak resident size by {rss_added / 2**20:.0f} MiB (limit "
                        f"{CASE_RSS_BYTES / 2**20:.0f} MiB)")
    return {"case": number, "argv": [a.replace(str(case), "CASE") for a in argv], "exit_code": result.exit_code,
            "stderr": result.stderr.strip()[-300:], "seconds": round(seconds, 3), "rss_added_bytes": rss_added,
            "problems": problems}


def run_campaign(seed: int, cases: range, work: Path) -> dict:
    seeds = _seed_files(work / "seeds")
    start_rss = _peak_rss()
    start = time.perf_counter()
    results = []
    for number in cases:
        case = work / f"case-{number}"
        print(f"case {number}", file=sys.stderr, flush=True)  # (the last one names a case that hangs)
        results.append(run_case(seed, number, seeds, case))
        shutil.rmtree(case, ignore_errors=True)
    return {"seed": seed, "cases": len(results), "seconds": round(time.perf_counter() - start, 1),
            "start_peak_rss_bytes": start_rss, "peak_rss_bytes": _peak_rss(),
            "exit_codes": {c: sum(str(r["exit_code"]) == c for r in results)
                           for c in sorted({str(r["exit_code"]) for r in results})},
            "slowest": sorted(results, key=lambda r: -r["seconds"])[:3],
            "failures": [r for r in results if r["problems"]]}


def _limit_address_space() -> None:
    with open("/proc/self/status") as fh:
        size = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
    limit = size + ADDRESS_SPACE_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--case", type=int, default=None, help="run only this case")
    parser.add_argument("--keep", type=Path, default=None, help="with --case: keep its files in this folder")
    args = parser.parse_args()
    if os.path.exists("/proc/self/status"):
        _limit_address_space()
    with tempfile.TemporaryDirectory(prefix="routetool-hostile-") as tmp:
        if args.case is not None:
            seeds = _seed_files(Path(tmp) / "seeds")
            case = args.keep or Path(tmp) / "case"
            print(json.dumps(run_case(args.seed, args.case, seeds, case), indent=2))
            return 0
        report = run_campaign(args.seed, range(args.cases), Path(tmp))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
