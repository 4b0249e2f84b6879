"""Routing dumps people already have -> per-layer expert ids or expert counts.

Readers (format names as ``--format`` takes them; ``auto`` picks by extension/content):

* ``jsonl``: one JSON object per line. Expert ids under ``topk_ids`` / ``experts`` /
  ``expert_ids`` / ``selected_experts`` / ``ids`` (a list for one token, or a list of lists
  for several), optional weights under ``topk_weights`` / ``gating_probs`` / ``weights`` /
  ``routing_weights``, the layer under ``layer`` / ``layer_id`` / ``layer_idx`` (default 0).
  Rows with ``"type": "meta"`` give ``model_id``, ``top_k`` / ``topk`` and ``num_experts``;
  other non-route rows are skipped. Steps: a new step starts, per layer, where ``step`` /
  ``forward_pass_id`` / ``batch`` changes, else where ``req_id`` / ``request_id`` /
  ``problem_id`` changes or ``token_idx`` does not increase.
* ``csv``: a header row; ids as a list (``"[8, 26, 56]"``) in ``Activated Expert IDs`` /
  ``topk_ids`` / ``expert_ids`` / ``experts``; optional ``Layer ID`` / ``layer``, step
  ``Batch Number`` / ``step`` / ``batch``, weights ``topk_weights`` / ``weights``. A folder of
  CSV files is read file by file (natural order); a step never spans two files.
* ``sglang``: ``.pt`` dumps of SGLang's expert-distribution recorder, loaded with
  ``torch.load(weights_only=True)``: ``per_token`` mode (``records`` holding
  ``topk_ids_of_layer`` ``[layers, tokens, 8]`` physical ids, -1 unused, mapped to logical
  experts through ``last_physical_to_logical_map``) gives ids; ``per_pass`` mode
  (``records`` with ``global_physical_count``) and ``stat`` mode (``logical_count``
  ``[steps, layers, experts]``) give counts. A folder of ``.pt`` files (one per rank) is
  merged by ``forward_pass_id``.
* ``counts-json``: tokens per expert per layer, nested under names, e.g.
  ``{model: {domain: {layer: {expert_id: count}}}}`` (or ``{layer: [counts]}``). The named
  tables chosen with ``select`` become the steps (one per domain, say).

Filters for warm-up and dummy rows (engines profile and capture CUDA graphs on dummy
batches whose rows are all identical): ``skip_rows`` drops the first N token rows of the
file; ``drop_repeats`` drops every run of at least that many consecutive identical rows
(same layer, ids and weights). Both are reported.

``num_experts`` / ``topk`` come from the options, else from the file's metadata, else are
inferred: E = largest id + 1 (with a note: an expert never picked would be missed), K = the
row width (every row must have the same).
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from routetool.errors import RouteToolError
from routetool.trace import LayerArrays, RouterConfig, TraceMeta, write_trace

FORMATS = ("auto", "trace", "jsonl", "csv", "sglang", "counts-json")
DEFAULT_DROP_REPEATS = 64
"""Runs of at least this many identical consecutive rows are dropped as warm-up/dummy rows."""

_ID_KEYS = ("topk_ids", "experts", "expert_ids", "selected_experts", "ids")
_WEIGHT_KEYS = ("topk_weights", "gating_probs", "weights", "routing_weights", "probs")
_LAYER_KEYS = ("layer", "layer_id", "layer_idx")
_STEP_KEYS = ("step", "forward_pass_id", "batch", "batch_number", "step_id")
_REQUEST_KEYS = ("req_id", "request_id", "problem_id", "seq_id")
_TOKEN_KEYS = ("token_idx", "token_index", "position")

_CSV_IDS = ("activated_expert_ids", "topk_ids", "expert_ids", "experts", "selected_experts", "ids")
_CSV_WEIGHTS = ("topk_weights", "weights", "gating_probs", "routing_weights", "expert_weights")
_CSV_LAYER = ("layer_id", "layer", "layer_idx")
_CSV_STEP = ("batch_number", "step", "batch", "forward_pass_id", "step_id")
_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


@dataclass
class ImportOptions:
    """How to read a routing dump.

    Attributes:
        format: one of :data:`FORMATS` (``auto``: by extension and content).
        num_experts / topk: E and K when the file does not say (None: infer).
        skip_rows: drop the first N token rows of the file (warm-up).
        drop_repeats: drop runs of at least this many identical consecutive rows
            (0 = keep everything).
        select: for counts JSON, the named tables to use (``model`` or ``model/domain``,
            a prefix of the names' path); None = all, if they agree on E.
        model: model name to record (default: from the file or its name).
    """

    format: str = "auto"
    num_experts: int | None = None
    topk: int | None = None
    skip_rows: int = 0
    drop_repeats: int = DEFAULT_DROP_REPEATS
    select: str | None = None
    model: str | None = None


@dataclass
class ImportedLayer:
    """Expert ids of one layer: ``topk_ids`` ``[T, K]`` int32, optional ``topk_weights``
    ``[T, K]`` float32, and ``step_offsets`` ``[0, ..., T]``."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor | None
    step_offsets: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def num_steps(self) -> int:
        return len(self.step_offsets) - 1


@dataclass
class ImportedRouting:
    """Per-token routing read from a dump (becomes an ids-only trace).

    Attributes:
        source: the file or folder read. format: the reader used. model: model name.
        num_experts / topk: E and K. layers: layer id -> :class:`ImportedLayer`.
        rows_read: token rows found (all layers). rows_skipped: dropped by ``skip_rows``.
        rows_dropped: dropped by ``drop_repeats``; runs_dropped: in how many runs.
        notes: how E/K were found, what was ignored, and similar facts worth telling.
    """

    source: str
    format: str
    model: str
    num_experts: int
    topk: int
    layers: dict[int, ImportedLayer]
    rows_read: int = 0
    rows_skipped: int = 0
    rows_dropped: int = 0
    runs_dropped: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(x.num_tokens for x in self.layers.values())


@dataclass
class ImportedCounts:
    """Tokens per expert read from a dump that has no per-token ids.

    Attributes:
        source / format / model: as in :class:`ImportedRouting`.
        num_experts: E. topk: K if known (then tokens = assignments / K), else None.
        layers: layer id -> ``[S, E]`` int64 counts of S steps (forward passes, or named
            tables such as text domains).
        step_labels: a name per step, or None.
        notes: facts worth telling.
    """

    source: str
    format: str
    model: str
    num_experts: int
    topk: int | None
    layers: dict[int, torch.Tensor]
    step_labels: list[str] | None = None
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------
# format detection
def _is_trace_index(path: Path) -> bool:
    """A sharded-trace index: JSON whose top-level ``format`` is ``routetool-trace-index``."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(65536)
    except OSError:
        return False
    return re.search(rb'"format"\s*:\s*"routetool-trace-index"', head) is not None


def detect_format(path: Path) -> str:
    """The reader for ``path`` (file or folder) by extension, then by content.

    Raises:
        RouteToolError: missing path, or nothing recognisable.
    """
    if not path.exists():
        raise RouteToolError("no such file or folder", path=path, fix="check the path")
    if path.is_dir():
        kinds = {p.suffix.lower() for p in path.iterdir() if p.is_file() and not p.name.startswith(".")}
        for suffixes, fmt in (((".csv",), "csv"), ((".pt", ".pth"), "sglang"), ((".jsonl", ".ndjson"), "jsonl")):
            if kinds & set(suffixes):
                if len(kinds & {".csv", ".pt", ".pth", ".jsonl", ".ndjson"}) > 1:
                    raise RouteToolError("the folder mixes dump formats", path=path,
                                         fix="put one kind of file (CSV, .pt or JSONL) in a folder")
                return fmt
        raise RouteToolError("the folder holds no .csv, .pt or .jsonl files", path=path,
                             fix="point at a routing dump or a folder of them")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return "trace"
    if suffix == ".json" and _is_trace_index(path):
        return "trace"  # a sharded trace's index (routetool.sharded)
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in (".csv", ".tsv"):
        return "csv"
    if suffix in (".pt", ".pth"):
        return "sglang"
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError as exc:
        raise RouteToolError(f"cannot read ({exc.strerror or exc})", path=path, fix="check permissions") from None
    text = head.lstrip()
    if text.startswith(b"{") and _is_trace_index(path):
        return "trace"
    if text.startswith(b"{"):
        first_line = text.split(b"\n", 1)[0].strip()
        try:
            json.loads(first_line)
            return "jsonl" if b"\n" in text.strip() else "counts-json"
        except json.JSONDecodeError:
            return "counts-json"
    if len(head) >= 8 and head[:8] != b"\x00" * 8 and b"__metadata__" in head[:4096]:
        return "trace"
    if head[:2] == b"PK":
        return "sglang"
    raise RouteToolError("cannot tell the format from the name or content", path=path,
                         fix="pass --format jsonl|csv|sglang|counts-json")


# ---------------------------------------------------------------------------------------
# shared row handling
@dataclass
class _Row:
    layer: int
    ids: tuple[int, ...]
    weights: tuple[float, ...] | None
    step_key: object
    where: str  # "line 17" for messages


def _natural_key(p: Path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _filter_rows(rows: list[_Row], options: ImportOptions) -> tuple[list[_Row], int, int, int]:
    """Apply skip_rows then drop_repeats. Returns (kept, skipped, dropped, runs)."""
    skipped = min(options.skip_rows, len(rows))
    rows = rows[skipped:]
    n = options.drop_repeats
    if n <= 0 or not rows:
        return rows, skipped, 0, 0
    kept: list[_Row] = []
    dropped = runs = 0
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or (rows[i].layer, rows[i].ids, rows[i].weights) != (rows[start].layer, rows[start].ids, rows[start].weights):
            if i - start >= n:
                dropped += i - start
                runs += 1
            else:
                kept.extend(rows[start:i])
            start = i
    return kept, skipped, dropped, runs


def _assemble(rows: list[_Row], source: Path, fmt: str, options: ImportOptions, model: str,
              meta_experts: int | None, meta_topk: int | None, notes: list[str]) -> ImportedRouting:
    """Rows (already filtered) -> per-layer tensors with step offsets, checking E and K."""
    if not rows:
        raise RouteToolError("no token rows left to import", path=source,
                             fix="check the file, --skip-rows and --drop-repeats")
    K = options.topk or meta_topk
    if K is None:
        widths = {len(r.ids) for r in rows}
        if len(widths) != 1:
            raise RouteToolError(f"rows have different numbers of expert ids ({sorted(widths)})", path=source,
                                 fix="pass --topk K (rows with another width are then an error)")
        K = widths.pop()
        notes.append(f"topk={K} taken from the row width")
    max_id = -1
    for r in rows:
        if len(r.ids) != K:
            raise RouteToolError(f"{r.where}: {len(r.ids)} expert ids, expected topk={K}", path=source,
                                 fix="fix the row, or pass the right --topk")
        if len(set(r.ids)) != K:
            raise RouteToolError(f"{r.where}: duplicate expert id in {list(r.ids)}", path=source,
                                 fix="each token picks distinct experts; fix the dump")
        if r.weights is not None and len(r.weights) != K:
            raise RouteToolError(f"{r.where}: {len(r.weights)} weights for {K} ids", path=source, fix="fix the row")
        lo = min(r.ids)
        if lo < 0:
            raise RouteToolError(f"{r.where}: negative expert id {lo}", path=source, fix="fix the row")
        max_id = max(max_id, max(r.ids))
    E = options.num_experts or meta_experts
    if E is None:
        E = max_id + 1
        notes.append(f"num_experts={E} inferred from the largest id ({max_id}); pass --num-experts if the model "
                     "has more (an expert never picked would be missed)")
    elif max_id >= E:
        bad = next(r for r in rows if max(r.ids) >= E)
        raise RouteToolError(f"{bad.where}: expert id {max(bad.ids)} >= num_experts={E}", path=source,
                             fix="pass the model's --num-experts")
    if K > E:
        raise RouteToolError(f"topk={K} > num_experts={E}", path=source, fix="pass --num-experts / --topk")
    has_weights = all(r.weights is not None for r in rows)
    if not has_weights and any(r.weights is not None for r in rows):
        notes.append("weights dropped: only some rows carry them")
    by_layer: dict[int, list[_Row]] = {}
    for r in rows:
        by_layer.setdefault(r.layer, []).append(r)
    layers: dict[int, ImportedLayer] = {}
    for layer in sorted(by_layer):
        lr = by_layer[layer]
        ids = torch.tensor([r.ids for r in lr], dtype=torch.int32)
        weights = torch.tensor([r.weights for r in lr], dtype=torch.float32) if has_weights else None
        offsets = [0]
        for i in range(1, len(lr)):
            if lr[i].step_key != lr[i - 1].step_key:
                offsets.append(i)
        offsets.append(len(lr))
        layers[layer] = ImportedLayer(topk_ids=ids, topk_weights=weights, step_offsets=offsets)
    return ImportedRouting(source=str(source), format=fmt, model=model, num_experts=E, topk=K,
                           layers=layers, notes=notes)


def _finish(result: ImportedRouting, rows_read: int, skipped: int, dropped: int, runs: int,
            options: ImportOptions) -> ImportedRouting:
    result.rows_read, result.rows_skipped, result.rows_dropped, result.runs_dropped = rows_read, skipped, dropped, runs
    if skipped:
        result.notes.insert(0, f"skipped the first {skipped:,} rows (--skip-rows)")
    if dropped:
        result.notes.insert(0, f"dropped {dropped:,} warm-up/dummy rows: {runs} run(s) of >= {options.drop_repeats} "
                               "identical consecutive rows (--drop-repeats 0 keeps them)")
    return result


# ---------------------------------------------------------------------------------------
# JSONL
def _first_key(obj: dict, keys: Iterable[str]):
    for k in keys:
        if k in obj:
            return k
    return None


def _jsonl_rows(path: Path, file_tag: object, notes: list[str], meta: dict) -> Iterator[_Row]:
    last: dict[int, tuple] = {}  # layer -> (explicit step, request, token_idx, step counter)
    ignored = 0
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise RouteToolError(f"cannot read ({exc.strerror or exc})", path=path, fix="check the path") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RouteToolError(f"line {lineno}: not JSON ({exc.msg})", path=path,
                                     fix="one JSON object per line (JSON Lines)") from None
            if not isinstance(obj, dict):
                raise RouteToolError(f"line {lineno}: not a JSON object", path=path, fix="one JSON object per line")
            if obj.get("type") == "meta":
                meta.update(obj)
                continue
            id_key = _first_key(obj, _ID_KEYS)
            if id_key is None:
                ignored += 1
                continue
            ids = obj[id_key]
            w_key = _first_key(obj, _WEIGHT_KEYS)
            weights = obj.get(w_key) if w_key else None
            layer_key = _first_key(obj, _LAYER_KEYS)
            try:
                layer = int(obj[layer_key]) if layer_key else 0
            except (TypeError, ValueError):
                raise RouteToolError(f"line {lineno}: {layer_key}={obj[layer_key]!r} is not an integer", path=path,
                                     fix="fix the row") from None
            token_rows = ids if ids and isinstance(ids[0], list) else [ids]
            weight_rows = weights if (weights and isinstance(weights[0], list)) else ([weights] if weights else None)
            step_key_name = _first_key(obj, _STEP_KEYS)
            req = tuple(obj.get(k) for k in _REQUEST_KEYS)
            tok_key = _first_key(obj, _TOKEN_KEYS)
            tok = obj.get(tok_key) if tok_key else None
            prev = last.get(layer)
            if step_key_name is not None:
                explicit = obj[step_key_name]
                counter = 0 if prev is None else prev[3] + (explicit != prev[0])
            else:
                explicit = None
                if prev is None:
                    counter = 0
                elif len(token_rows) > 1 or req != prev[1] or tok is None or prev[2] is None or tok <= prev[2]:
                    counter = prev[3] + 1
                else:
                    counter = prev[3]
            last[layer] = (explicit, req, tok, counter)
            for i, row in enumerate(token_rows):
                try:
                    row_ids = tuple(int(x) for x in row)
                    row_w = tuple(float(x) for x in weight_rows[i]) if weight_rows else None
                except (TypeError, ValueError, IndexError):
                    raise RouteToolError(f"line {lineno}: {id_key}/{w_key} are not lists of numbers", path=path,
                                         fix="fix the row") from None
                yield _Row(layer, row_ids, row_w, (file_tag, counter), f"line {lineno}")
    if ignored:
        notes.append(f"{path.name}: ignored {ignored:,} lines without expert ids")


def _meta_int(meta: dict, *keys: str) -> int | None:
    for k in keys:
        if k in meta and meta[k] is not None:
            try:
                return int(meta[k])
            except (TypeError, ValueError):
                return None
    return None


def read_jsonl(path: Path, options: ImportOptions) -> ImportedRouting:
    """Read a JSON-lines routing dump (or a folder of them). See the module docstring."""
    files = sorted((p for p in path.iterdir() if p.suffix.lower() in (".jsonl", ".ndjson")), key=_natural_key) \
        if path.is_dir() else [path]
    notes: list[str] = []
    meta: dict = {}
    rows: list[_Row] = []
    for i, f in enumerate(files):
        rows.extend(_jsonl_rows(f, i, notes, meta))
    read = len(rows)
    rows, skipped, dropped, runs = _filter_rows(rows, options)
    model = options.model or str(meta.get("model_id") or meta.get("model") or path.stem)
    result = _assemble(rows, path, "jsonl", options, model, _meta_int(meta, "num_experts", "n_experts"),
                       _meta_int(meta, "top_k", "topk", "num_experts_per_tok"), notes)
    return _finish(result, read, skipped, dropped, runs, options)


# ---------------------------------------------------------------------------------------
# CSV
def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.strip().lower()).strip("_")


def read_csv(path: Path, options: ImportOptions) -> ImportedRouting:
    """Read a CSV routing dump, or a folder of CSV files. See the module docstring."""
    files = sorted((p for p in path.iterdir() if p.suffix.lower() in (".csv", ".tsv")), key=_natural_key) \
        if path.is_dir() else [path]
    rows: list[_Row] = []
    notes: list[str] = []
    for file_no, f in enumerate(files):
        try:
            fh = open(f, newline="", encoding="utf-8")
        except OSError as exc:
            raise RouteToolError(f"cannot read ({exc.strerror or exc})", path=f, fix="check the path") from None
        with fh:
            reader = csv.reader(fh, delimiter="\t" if f.suffix.lower() == ".tsv" else ",")
            try:
                header = next(reader)
            except StopIteration:
                continue
            except csv.Error as exc:
                raise RouteToolError(f"not a CSV file ({exc})", path=f, fix="pass a CSV with a header row") from None
            names = [_norm(h) for h in header]

            def col(candidates, names=names):
                for c in candidates:
                    if c in names:
                        return names.index(c)
                return None

            c_ids, c_w, c_layer, c_step = col(_CSV_IDS), col(_CSV_WEIGHTS), col(_CSV_LAYER), col(_CSV_STEP)
            if c_ids is None:
                raise RouteToolError(f"no expert-id column in the header {header}", path=f,
                                     fix="name it 'Activated Expert IDs', 'topk_ids' or 'expert_ids'")
            try:
                for lineno, rec in enumerate(reader, 2):
                    if not rec:
                        continue
                    if len(rec) != len(header):
                        raise RouteToolError(f"line {lineno}: {len(rec)} fields, header has {len(header)}", path=f,
                                             fix="quote fields that contain commas")
                    ids = tuple(int(x) for x in _INT.findall(rec[c_ids]))
                    weights = tuple(float(x) for x in _FLOAT.findall(rec[c_w])) if c_w is not None else None
                    try:
                        layer = int(rec[c_layer]) if c_layer is not None else 0
                        step = rec[c_step] if c_step is not None else None
                    except ValueError:
                        raise RouteToolError(f"line {lineno}: layer {rec[c_layer]!r} is not an integer", path=f,
                                             fix="fix the row") from None
                    rows.append(_Row(layer, ids, weights, (file_no, step), f"{f.name} line {lineno}"))
            except csv.Error as exc:
                raise RouteToolError(f"malformed CSV ({exc})", path=f, fix="fix the file") from None
    if len(files) > 1:
        notes.append(f"read {len(files)} CSV files; each file's batches are separate steps")
    read = len(rows)
    rows, skipped, dropped, runs = _filter_rows(rows, options)
    model = options.model or path.stem
    result = _assemble(rows, path, "csv", options, model, None, None, notes)
    return _finish(result, read, skipped, dropped, runs, options)


# ---------------------------------------------------------------------------------------
# SGLang expert-distribution dumps
def _torch_load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise RouteToolError("no such file", path=path, fix="check the path") from None
    except Exception as exc:  # noqa: BLE001 - pickle errors of any kind are bad input
        raise RouteToolError(f"cannot load with torch.load(weights_only=True) ({type(exc).__name__}: {exc})",
                             path=path, fix="pass an SGLang expert-distribution dump (.pt)") from None


def _phys_to_log(path: Path, obj: dict, num_layers: int, num_physical: int) -> tuple[torch.Tensor, bool]:
    m = obj.get("last_physical_to_logical_map")
    if m is None:
        return torch.arange(num_physical).repeat(num_layers, 1), False
    m = torch.as_tensor(m).long()
    if m.dim() != 2 or m.shape[0] != num_layers or m.shape[1] != num_physical:
        raise RouteToolError(f"last_physical_to_logical_map has shape {list(m.shape)}; expected "
                             f"[{num_layers}, {num_physical}]", path=path, fix="pass an unmodified SGLang dump")
    return m, True


def read_sglang(path: Path, options: ImportOptions) -> ImportedRouting | ImportedCounts:
    """Read SGLang expert-distribution recorder dumps (a ``.pt`` file or a folder of them)."""
    files = sorted((p for p in path.iterdir() if p.suffix.lower() in (".pt", ".pth")), key=_natural_key) \
        if path.is_dir() else [path]
    objs = [(f, _torch_load(f)) for f in files]
    for f, obj in objs:
        if not isinstance(obj, dict) or not ({"records", "logical_count"} & set(obj)):
            raise RouteToolError("not an SGLang expert-distribution dump (no 'records' or 'logical_count')", path=f,
                                 fix="dump with /dump_expert_distribution_record, or pick another --format")
    notes: list[str] = []
    model = options.model or path.stem
    if all("logical_count" in obj for _, obj in objs):
        return _sglang_stat(path, objs, options, model, notes)
    if any("logical_count" in obj for _, obj in objs):
        raise RouteToolError("the folder mixes stat and per-pass dumps", path=path, fix="read one mode at a time")
    records = []
    maps = {}
    for f, obj in objs:
        if not isinstance(obj["records"], list):
            raise RouteToolError("'records' is not a list", path=f, fix="pass an unmodified SGLang dump")
        for r in obj["records"]:
            if not isinstance(r, dict) or "forward_pass_id" not in r:
                raise RouteToolError("a record lacks forward_pass_id", path=f, fix="pass an unmodified SGLang dump")
            records.append((int(r["forward_pass_id"]), int(r.get("rank", 0)), f, r))
        maps[f] = obj
    if not records:
        raise RouteToolError("holds no records", path=path, fix="record some traffic before dumping")
    records.sort(key=lambda x: (x[0], x[1]))
    if all("topk_ids_of_layer" in r for *_, r in records):
        return _sglang_per_token(path, records, maps, options, model, notes)
    return _sglang_per_pass(path, records, maps, options, model, notes)


def _sglang_stat(path: Path, objs, options: ImportOptions, model: str, notes: list[str]) -> ImportedCounts:
    chunks = []
    for f, obj in objs:
        lc = torch.as_tensor(obj["logical_count"]).long()
        if lc.dim() == 2:
            lc = lc[None]
        if lc.dim() != 3:
            raise RouteToolError(f"logical_count has shape {list(lc.shape)}; expected [steps, layers, experts]",
                                 path=f, fix="pass an unmodified SGLang dump")
        chunks.append(lc)
    lc = torch.cat(chunks)
    empty = lc.sum(dim=(1, 2)) == 0
    if empty.any():
        notes.append(f"ignored {int(empty.sum())} empty steps (unfilled slots of the recorder's buffer)")
    lc = lc[~empty]
    if lc.shape[0] == 0:
        raise RouteToolError("every step of logical_count is empty", path=path, fix="record some traffic before dumping")
    E = lc.shape[2]
    if options.num_experts and options.num_experts != E:
        raise RouteToolError(f"logical_count has {E} experts, --num-experts says {options.num_experts}", path=path,
                             fix="drop --num-experts or fix it")
    layers = {}
    for layer in range(lc.shape[1]):
        if lc[:, layer].sum() > 0:
            layers[layer] = lc[:, layer].clone()
    skipped = lc.shape[1] - len(layers)
    if skipped:
        notes.append(f"{skipped} layer(s) without any routed token (dense layers) left out")
    notes.append("SGLang stat dump: per-step expert counts, no per-token ids")
    return ImportedCounts(source=str(path), format="sglang", model=model, num_experts=E, topk=options.topk,
                          layers=layers, notes=notes)


def _sglang_per_pass(path: Path, records, maps, options, model, notes) -> ImportedCounts:
    steps: dict[int, torch.Tensor] = {}
    E = None
    for fp, _rank, f, r in records:
        g = torch.as_tensor(r.get("global_physical_count")).long()
        if g.dim() != 2:
            raise RouteToolError("a record's global_physical_count is not [layers, physical experts]", path=f,
                                 fix="pass an unmodified SGLang dump")
        m, _ = _phys_to_log(f, maps[f], g.shape[0], g.shape[1])
        E = int(m.max()) + 1 if options.num_experts is None else options.num_experts
        logical = torch.zeros(g.shape[0], E, dtype=torch.int64).scatter_add_(1, m, g)
        steps[fp] = steps.get(fp, 0) + logical
    stacked = torch.stack([steps[k] for k in sorted(steps)])  # [S, L, E]
    layers = {layer: stacked[:, layer].clone() for layer in range(stacked.shape[1]) if stacked[:, layer].sum() > 0}
    notes.append("SGLang per-pass dump: per-step expert counts (physical counts mapped to logical experts)")
    return ImportedCounts(source=str(path), format="sglang", model=model, num_experts=E, topk=options.topk,
                          layers=layers, notes=notes)


def _sglang_per_token(path: Path, records, maps, options, model, notes) -> ImportedRouting:
    rows: list[_Row] = []
    mapped = False
    for fp, rank, f, r in records:
        ids = torch.as_tensor(r["topk_ids_of_layer"]).long()  # [L, n, 8] physical ids, -1 unused
        if ids.dim() != 3:
            raise RouteToolError("a record's topk_ids_of_layer is not [layers, tokens, k]", path=f,
                                 fix="pass an unmodified SGLang dump")
        L = ids.shape[0]
        m_obj = maps[f].get("last_physical_to_logical_map")
        num_phys = int(torch.as_tensor(m_obj).shape[1]) if m_obj is not None else int(ids.max()) + 1
        m, has_map = _phys_to_log(f, maps[f], L, max(num_phys, 1))
        mapped |= has_map
        valid = ids >= 0
        if int(ids.max()) >= m.shape[1]:
            raise RouteToolError(f"forward pass {fp}: physical id {int(ids.max())} outside the map", path=f,
                                 fix="pass an unmodified SGLang dump")
        logical = torch.where(valid, torch.gather(m, 1, ids.clamp(min=0).flatten(1)).view_as(ids), -1)
        for layer in range(L):
            for t in range(ids.shape[1]):
                row = [int(x) for x in logical[layer, t].tolist() if x >= 0]
                if row:
                    rows.append(_Row(layer, tuple(row), None, (fp,), f"{f.name} pass {fp} layer {layer} token {t}"))
    if mapped:
        notes.append("physical expert ids mapped to logical experts with last_physical_to_logical_map")
    read = len(rows)
    rows.sort(key=lambda r: r.layer)  # stable: keeps pass and token order within a layer
    rows, skipped, dropped, runs = _filter_rows(rows, options)
    E = options.num_experts
    if E is None:
        ms = [torch.as_tensor(o["last_physical_to_logical_map"]) for o in maps.values()
              if o.get("last_physical_to_logical_map") is not None]
        E = int(max(int(x.max()) for x in ms)) + 1 if ms else None
    result = _assemble(rows, path, "sglang", options, model, E, None, notes)
    return _finish(result, read, skipped, dropped, runs, options)


# ---------------------------------------------------------------------------------------
# counts JSON
def _is_int(s) -> bool:
    try:
        int(s)
        return True
    except (TypeError, ValueError):
        return False


def _counts_vector(value, where: str, path: Path) -> dict[int, int]:
    if isinstance(value, list):
        items = enumerate(value)
    elif isinstance(value, dict) and all(_is_int(k) for k in value):
        items = ((int(k), v) for k, v in value.items())
    else:
        raise RouteToolError(f"{where}: expected {{expert_id: count}} or a list of counts", path=path, fix="fix the file")
    out = {}
    for e, c in items:
        if isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0 or c != int(c):
            raise RouteToolError(f"{where}: expert {e} count {c!r} is not a non-negative integer", path=path,
                                 fix="fix the file")
        out[int(e)] = int(c)
    return out


def _layer_tables(node, names: tuple[str, ...], path: Path) -> Iterator[tuple[tuple[str, ...], dict]]:
    if isinstance(node, dict) and node and all(_is_int(k) for k in node):
        vals = list(node.values())
        if all(isinstance(v, (dict, list)) for v in vals):
            yield names, {int(k): _counts_vector(v, "/".join(names + (str(k),)), path) for k, v in node.items()}
            return
        if all(isinstance(v, (int, float)) for v in vals):  # {expert: count} without layers
            yield names, {0: _counts_vector(node, "/".join(names) or "top level", path)}
            return
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, (dict, list)):
                yield from _layer_tables(v, names + (str(k),), path)
    elif isinstance(node, list) and node and all(isinstance(v, (int, float)) for v in node):
        yield names, {0: _counts_vector(node, "/".join(names) or "top level", path)}


def read_counts_json(path: Path, options: ImportOptions) -> ImportedCounts:
    """Read tokens per expert per layer from a nested JSON (see the module docstring)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RouteToolError(f"not a readable JSON file ({exc})", path=path, fix="fix the file") from None
    tables = list(_layer_tables(doc, (), path))
    if not tables:
        raise RouteToolError("no {layer: {expert_id: count}} tables found", path=path,
                             fix="use {model: {domain: {layer: {expert_id: count}}}} or {layer: [counts]}")
    names = ["/".join(n) for n, _ in tables]
    if options.select:
        sel = options.select.strip("/")
        tables = [t for t, n in zip(tables, names) if n == sel or n.startswith(sel + "/")]
        if not tables:
            raise RouteToolError(f"--select {options.select!r} matches no table", path=path,
                                 fix=f"choose among {', '.join(names[:12])}")
    widths = {}
    for n, t in tables:
        widths["/".join(n)] = max(max(v) for v in t.values() if v) + 1
    E = options.num_experts or max(widths.values())
    groups = {n[0] if len(n) > 1 else "" for n, _ in tables}
    if options.num_experts is None and len(set(widths.values())) > 1:
        first = sorted(groups)
        raise RouteToolError(f"the tables have different expert counts ({sorted(set(widths.values()))}): "
                             "several models in one file", path=path,
                             fix=f"choose one with --select (e.g. {', '.join(first[:4])})")
    if max(widths.values()) > E:
        raise RouteToolError(f"expert id {max(widths.values()) - 1} >= --num-experts {E}", path=path,
                             fix="fix --num-experts")
    all_layers = sorted({layer for _, t in tables for layer in t})
    layers = {}
    for layer in all_layers:
        m = torch.zeros(len(tables), E, dtype=torch.int64)
        for i, (_, t) in enumerate(tables):
            for e, c in t.get(layer, {}).items():
                m[i, e] = c
        layers[layer] = m
    labels = ["/".join(n) or "all" for n, _ in tables]
    common = 0
    if len(tables) > 1:
        parts = [n for n, _ in tables]
        while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
            common += 1
        labels = ["/".join(p[common:]) for p in parts]
    model = options.model or ("/".join(tables[0][0][:common]) if common else path.stem)
    notes = [f"per-expert counts of {len(tables)} table(s), one step each: {', '.join(labels[:8])}"
             + (" ..." if len(labels) > 8 else "")]
    if options.topk is None:
        notes.append("topk unknown: token counts are not shown (pass --topk to get them)")
    return ImportedCounts(source=str(path), format="counts-json", model=model, num_experts=E, topk=options.topk,
                          layers=layers, step_labels=labels, notes=notes)


# ---------------------------------------------------------------------------------------
# entry points
def read_dump(path: str | Path, options: ImportOptions | None = None) -> ImportedRouting | ImportedCounts:
    """Read any supported routing dump (not a trace).

    Returns:
        :class:`ImportedRouting` for per-token ids, :class:`ImportedCounts` for counts.

    Raises:
        RouteToolError: unknown format, malformed rows (naming the file and line), E/K
            contradictions.
    """
    options = options or ImportOptions()
    path = Path(path)
    fmt = detect_format(path) if options.format == "auto" else options.format
    if options.format != "auto" and not path.exists():
        raise RouteToolError("no such file or folder", path=path, fix="check the path")
    if fmt == "trace":
        raise RouteToolError("is already a routetool trace", path=path, fix="analyse it with `routetool balance`")
    readers = {"jsonl": read_jsonl, "csv": read_csv, "sglang": read_sglang, "counts-json": read_counts_json}
    if fmt not in readers:
        raise RouteToolError(f"unknown format {fmt!r}", fix=f"use one of {', '.join(FORMATS)}")
    return readers[fmt](path, options)


def write_imported_trace(imported: ImportedRouting, out: str | Path, *, force: bool = False) -> Path:
    """Write per-token routing as an ids-only trace (docs/trace-format.md).

    The router parameters other than E and K are unknown for a dump; the trace records
    ``route_scale=1`` as a placeholder and says so in ``router_parameters``.

    Raises:
        RouteToolError: as :func:`routetool.trace.write_trace` (existing file without
            ``force`` ...).
    """
    meta = TraceMeta(
        model=imported.model,
        router=RouterConfig(num_experts=imported.num_experts, topk=imported.topk, route_scale=1.0),
        provenance=f"routetool import of {imported.source} ({imported.format}); " + "; ".join(imported.notes),
        extra={
            "import_format": imported.format,
            "router_parameters": "unknown (ids-only import: only num_experts and topk are real)",
            "import_rows_dropped": str(imported.rows_dropped),
            "import_rows_skipped": str(imported.rows_skipped),
        },
    )
    layers = {
        layer: LayerArrays(
            topk_ids=x.topk_ids.to(torch.int32),
            topk_weights=x.topk_weights,
            step_offsets=torch.tensor(x.step_offsets, dtype=torch.int64),
        )
        for layer, x in imported.layers.items()
    }
    return write_trace(out, meta, layers, force=force)
