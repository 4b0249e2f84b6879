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
* ``csv``: a header row; ids as a list (``"[8, 26, 56]"``, brackets closed) in ``Activated Expert IDs`` /
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
* ``vllm``, ``sglang-routed``, ``megatron``, ``megatron-ep-load``, ``flashinfer-trace``: what the
  engines emit themselves (routed experts of vLLM and SGLang, Megatron's RouterReplay and
  expert-load dumps, FlashInfer-Trace MoE workloads with logits), read by
  :mod:`routetool.io.engine_dumps`. :func:`iter_steps` walks any format's result step by step,
  with the request labels and token positions the format records.
* ``counts-json``: tokens per expert per layer, nested under names, e.g.
  ``{model: {domain: {layer: {expert_id: count}}}}`` (or ``{layer: [counts]}``; one form per
  table, never both). The named tables chosen with ``select`` become the steps (one per
  domain, say). ``topk`` above the number of experts inferred from the counts is an error.

Filters for warm-up and dummy rows (engines profile and capture CUDA graphs on dummy
batches whose rows are all identical): ``skip_rows`` drops the first N token rows of the
file; ``drop_repeats`` drops every run of at least that many consecutive identical rows
(same layer, ids and weights). Both are reported.

Each format reads only some of the options (:data:`OPTIONS_READ`): token-row dumps (JSON
lines, CSV, SGLang per-token) ``num_experts``, ``topk``, ``skip_rows`` and ``drop_repeats``;
counts JSON ``num_experts``, ``topk`` and ``select``; SGLang stat and per-pass dumps
``num_experts`` and ``topk``. Another one given for a dump is an error, never ignored.

``num_experts`` / ``topk`` come from the options, else from the file's metadata, else are
inferred: E = largest id + 1 (with a note: an expert never picked would be missed), K = the
row width (every row must have the same: the first row of another width is named, with the
first row's).

Numbers are checked, not coerced: expert ids and layers must be integers (``3`` or ``3.0``,
never ``1.5``, ``true`` or NaN), ids in ``[0, E)`` with E at most :data:`MAX_EXPERTS`, layers
in ``[0, MAX_LAYERS)``, weights finite (also as float32) and >= 0, counts finite non-negative
integers. In JSON, numbers are JSON numbers
(``"3"`` is an error, not 3); integers written as text (CSV cells, counts-JSON keys) are plain
ASCII digits, read by :mod:`routetool.numtext` (``int()`` would also read ``" 1"``, ``1_0`` and
other scripts' digits). Nothing is said two ways
and silently resolved: a JSON key given twice in one object, two names of one field in a row
or a CSV header (``topk_ids`` and ``experts``: the names above are alternatives), meta rows that
disagree, or one layer or expert spelled two ways (``"0"`` and ``"00"``), is an error. Every failure, including text that is not UTF-8,
is a :class:`RouteToolError` of one line naming the file and the line, key or tensor element.

JSON is read by :mod:`routetool.io.jsonstrict` (keys once per object, nesting and number length
bounded), paths are examined by :func:`routetool.io.paths.path_kind`, and what a dump may make the
tool allocate is checked on declared sizes first (:mod:`routetool.io.limits`): the per-expert tables
E makes over the dump's steps and layers, an SGLang ``.pt``'s records and tensors counted as
materialised (stride-0 views and shared references in full).
"""

from __future__ import annotations

import csv
import json
import math
import re
import shlex
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from routetool.errors import RouteToolError
from routetool.io.engine_dumps import (read_flashinfer, read_megatron, read_megatron_ep_load, read_sglang_routed,
                                       read_vllm)
from routetool.io.imported import (  # noqa: F401 - what the readers return, part of this interface
    DumpStep, ImportedCounts, ImportedLayer, ImportedRouting, ImportOptions, _refuse_counts, _torch_load, iter_steps,
    one_line,
)
from routetool.io.inputs import (  # noqa: F401 - format detection, part of this interface
    DUMP_SUFFIXES, _detected, _is_trace_index, _refuse_special_files, detect_format, refuse_dump_as_trace,
)
from routetool.io.jsonstrict import JSONProblem, load_file, loads
from routetool.io.limits import MAX_EXPERTS, MAX_LAYERS, check_expert_tables, input_bytes
from routetool.io.paths import natural_key as _natural_key
from routetool.io.paths import require_input
from routetool.numtext import parse_float, parse_int
from routetool.io.trace import LayerArrays, RouterConfig, TraceMeta, write_trace

from routetool.io.dump_options import (  # noqa: F401 - the options of the importers, part of this interface
    COUNTS_OPTIONS, DEFAULT_DROP_REPEATS, FORMATS, OPTIONS_READ, READING_OPTIONS,
)

_ID_KEYS = ("topk_ids", "experts", "expert_ids", "selected_experts", "ids")
_WEIGHT_KEYS = ("topk_weights", "gating_probs", "weights", "routing_weights", "probs")
_LAYER_KEYS = ("layer", "layer_id", "layer_idx")
_STEP_KEYS = ("step", "forward_pass_id", "batch", "batch_number", "step_id")
_REQUEST_KEYS = ("req_id", "request_id", "problem_id", "seq_id")
_TOKEN_KEYS = ("token_idx", "token_index", "position")
_META_NUMBERS = ("num_experts", "n_experts", "top_k", "topk", "num_experts_per_tok")

_CSV_IDS = ("activated_expert_ids", "topk_ids", "expert_ids", "experts", "selected_experts", "ids")
_CSV_WEIGHTS = ("topk_weights", "weights", "gating_probs", "routing_weights", "expert_weights")
_CSV_LAYER = ("layer_id", "layer", "layer_idx")
_CSV_STEP = ("batch_number", "step", "batch", "forward_pass_id", "step_id")
_CSV_SPLIT = re.compile(r"[\s,;\[\]()]+")

MAX_COUNT = 1 << 62
"""Largest per-expert count accepted in counts files (int64 headroom for sums)."""


def _as_int(value, *, text: bool = True) -> int | None:
    """``value`` as an int when it is an integer (int, integral float, and with ``text`` integer
    text: plain ASCII digits with an optional sign, read by :func:`routetool.numtext.parse_int`,
    so ``" 1"``, ``"1_0"`` and other scripts' digits are not integers although ``int()`` reads
    them); else None.

    Booleans, fractions, NaN/inf and other types are not integers.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if text and isinstance(value, str):
        return parse_int(value)
    return None


def _json_string_number(value) -> bool:
    """A JSON string holding what looks like a number (``"3"``): a number written as text."""
    return isinstance(value, str) and _as_int(value) is not None


def _layer_index(value, where: str, key: str, path: Path, spellings: dict[int, tuple[str, str]] | None = None,
                 *, text: bool = True, label: str | None = None) -> int:
    """The layer ``value`` names (in ``[0, MAX_LAYERS)``).

    ``text``: integer text is a layer (CSV cells); without it a string is an error (JSON numbers).
    ``spellings``: layer -> (text, where) of its first spelling: another spelling of the same
    layer (``"00"`` after ``"0"``) is an error, never the same layer under two names. ``label``:
    where this row is, as recorded there (default ``where``).
    """
    if not text and _json_string_number(value):
        raise RouteToolError(f"{where}: {key}={_short(value)} is a string, not a JSON number", path=path,
                             fix=f"write the layer as a number: \"{key}\": {_as_int(value)}, without quotes")
    layer = _as_int(value, text=text)
    if layer is None and text and _loose_int(value):  # " 1", "1_0", Arabic-Indic digits: int() reads them
        raise RouteToolError(f"{where}: {key}={value!r} is not a plain decimal layer index", path=path,
                             fix="write the layer in ASCII digits 0-9, without spaces, underscores or other scripts' "
                                 "digits")
    if layer is None or not 0 <= layer < MAX_LAYERS:
        shown = repr(value) if isinstance(value, str) else _short(value)
        raise RouteToolError(f"{where}: {key}={shown} is not a layer index (an integer in [0, {MAX_LAYERS:,}))",
                             path=path, fix="fix the row")
    if spellings is not None and isinstance(value, str):
        spelled = value
        first = spellings.setdefault(layer, (spelled, label or where))
        if first[0] != spelled:
            raise RouteToolError(f"{where}: {key}={spelled!r} and {first[0]!r} ({first[1]}) name the same layer {layer}",
                                 path=path, fix=f"spell each layer one way in the whole dump (e.g. {layer})")
    return layer


# ---------------------------------------------------------------------------------------
# shared row handling
@dataclass
class _Row:
    layer: int
    ids: tuple[int, ...]
    weights: tuple[float, ...] | None
    step_key: object
    where: str  # "line 17" for messages
    position: int | None = None  # the token's position in its sequence, where the dump records it


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
              meta_experts: int | None, meta_topk: int | None, notes: list[str], size: int) -> ImportedRouting:
    """Rows (already filtered) -> per-layer tensors with step offsets, checking E and K, and the
    per-expert tables E makes against the budget of an input of ``size`` bytes
    (:func:`routetool.io.limits.check_expert_tables`) before any tensor is made."""
    if not rows:
        dropped = bool(options.skip_rows) or "drop_repeats" in (options.given or ())  # (what the user asked to drop)
        raise RouteToolError("no token rows left to read" + (" after --skip-rows / --drop-repeats" if dropped else ""),
                             path=source, fix="check that the file holds routed tokens" +
                             (" and what --skip-rows and --drop-repeats drop" if dropped else ""))
    empty = next((r for r in rows if not r.ids), None)
    if empty is not None:
        raise RouteToolError(f"{empty.where}: no expert ids (an empty list)", path=source,
                             fix="fix the row: every token row lists its topk expert ids")
    K = options.topk if options.topk is not None else meta_topk
    if K is not None and not 1 <= K <= MAX_EXPERTS:
        raise RouteToolError(f"topk={K} (from the file's metadata) is not in [1, {MAX_EXPERTS:,}]", path=source,
                             fix="pass the model's --topk")
    if K is None:
        first = rows[0]
        odd = next((r for r in rows if len(r.ids) != len(first.ids)), None)
        if odd is not None:  # named like a row of the wrong width under --topk
            raise RouteToolError(f"{odd.where}: {len(odd.ids)} expert ids, where the first row ({first.where}) has "
                                 f"{len(first.ids)}", path=source,
                                 fix="every row lists topk expert ids: fix the row, or pass the model's --topk")
        K = len(first.ids)
        notes.append(f"topk={K} taken from the row width")
    max_id = -1
    for r in rows:
        if len(r.ids) != K:
            raise RouteToolError(f"{r.where}: {len(r.ids)} expert ids, expected topk={K}", path=source,
                                 fix="fix the row, or pass the right --topk")
        lo, hi = min(r.ids), max(r.ids)
        if lo < 0:
            raise RouteToolError(f"{r.where}: negative expert id {lo}", path=source, fix="fix the row")
        if hi >= MAX_EXPERTS:
            raise RouteToolError(f"{r.where}: expert id {hi} is out of range (at most {MAX_EXPERTS - 1:,})",
                                 path=source, fix="fix the row")
        if len(set(r.ids)) != K:
            raise RouteToolError(f"{r.where}: duplicate expert id in {list(r.ids)}", path=source,
                                 fix="each token picks distinct experts; fix the dump")
        if r.weights is not None and len(r.weights) != K:
            raise RouteToolError(f"{r.where}: {len(r.weights)} weights for {K} ids", path=source, fix="fix the row")
        max_id = max(max_id, hi)
    E = options.num_experts if options.num_experts is not None else meta_experts
    if E is not None and not 1 <= E <= MAX_EXPERTS:
        raise RouteToolError(f"num_experts={E} (from the file's metadata) is not in [1, {MAX_EXPERTS:,}]",
                             path=source, fix="pass the model's --num-experts")
    top = next(r for r in rows if max(r.ids) == max_id)
    if options.num_experts is not None:
        budget_fix = "pass the model's --num-experts"
    elif E is not None:
        budget_fix = "fix the num_experts the dump declares, or pass the model's --num-experts"
    else:
        budget_fix = (f"the largest expert id, {max_id} ({top.where}), sets num_experts: fix that row, or pass the "
                      "model's --num-experts")
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
    offsets: dict[int, list[int]] = {}
    for layer, lr in by_layer.items():
        offsets[layer] = [0] + [i for i in range(1, len(lr)) if lr[i].step_key != lr[i - 1].step_key] + [len(lr)]
    check_expert_tables(source, experts=E, layer_steps=sum(len(o) - 1 for o in offsets.values()),
                        layers=len(by_layer), size=size, fix=budget_fix)
    layers: dict[int, ImportedLayer] = {}
    for layer in sorted(by_layer):
        lr = by_layer[layer]
        ids = torch.tensor([r.ids for r in lr], dtype=torch.int32)
        weights = torch.tensor([r.weights for r in lr], dtype=torch.float32) if has_weights else None
        positions = torch.tensor([r.position for r in lr], dtype=torch.int64) \
            if all(r.position is not None for r in lr) else None
        layers[layer] = ImportedLayer(topk_ids=ids, topk_weights=weights, step_offsets=offsets[layer],
                                      positions=positions)
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
def _one_key(obj: dict, keys: Iterable[str], field: str, where: str, path: Path):
    """The one key of ``obj`` among ``keys`` (names of one field), or None; two of them in one
    row (``topk_ids`` and ``experts``) are an error, never one picked silently."""
    found = [k for k in keys if k in obj]
    if len(found) > 1:
        raise RouteToolError(f"{where}: the keys {found[0]!r} and {found[1]!r} both give the {field}", path=path,
                             fix=f"keep one of them (the reader takes the {field} from one key)")
    return found[0] if found else None


def _json_ids(value, where: str, key: str, path: Path) -> tuple[int, ...]:
    """One token's expert ids: a list of integers (ints, integral floats or integer text)."""
    if not isinstance(value, list):
        raise RouteToolError(f"{where}: {key} is {type(value).__name__} {_short(value)}, not a list of expert ids",
                             path=path, fix="fix the row")
    out = []
    for x in value:
        if _json_string_number(x):
            raise RouteToolError(f"{where}: expert id {_short(x)} in {key} is a string, not a JSON number", path=path,
                                 fix=f"write expert ids as numbers ({_as_int(x)}, without quotes); fix the dump's writer")
        v = _as_int(x, text=False)
        if v is None:
            raise RouteToolError(f"{where}: expert id {_short(x)} in {key} is not an integer", path=path,
                                 fix="expert ids are integers; fix the row")
        out.append(v)
    return tuple(out)


_MAX_WEIGHT = torch.finfo(torch.float32).max
"""Weights are stored as float32: a larger one would become infinite."""


def _check_weight(value: float, shown: str, where: str, column: str, path: Path) -> float:
    """``value`` when it is a weight a trace can hold: finite (also as float32) and >= 0.

    ``shown``: the value as the dump writes it, for the message. Replay refuses non-finite and
    negative recorded weights; import refuses them where they are read, naming the line/row
    and the column or key."""
    if not math.isfinite(value):
        raise RouteToolError(f"{where}: weight {shown} in {column!r} is not a finite number", path=path,
                             fix="weights must be finite and >= 0; a number beyond the float range, like 1e400, "
                                 "is infinite; fix the row")
    if abs(value) > _MAX_WEIGHT:
        raise RouteToolError(f"{where}: weight {shown} in {column!r} is too large for a float32 weight (at most "
                             f"{_MAX_WEIGHT:.4g})", path=path, fix="weights must be finite and >= 0; fix the row")
    if value < 0:
        raise RouteToolError(f"{where}: weight {shown} in {column!r} is negative", path=path,
                             fix="weights must be finite and >= 0; fix the row")
    return value


def _json_weights(value, where: str, key: str, path: Path) -> tuple[float, ...]:
    if not isinstance(value, list) or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in value):
        raise RouteToolError(f"{where}: {key} is not a list of numbers ({_short(value)})", path=path, fix="fix the row")
    weights = tuple(float(x) for x in value)  # (an integer of at most 100 digits: jsonstrict)
    return tuple(_check_weight(w, _short(x), where, key, path) for w, x in zip(weights, value))


def _short(value, limit: int = 40) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonl_rows(path: Path, file_tag: object, notes: list[str], meta: dict) -> Iterator[_Row]:
    last: dict[int, tuple] = {}  # layer -> (explicit step, request, token_idx, step counter)
    ignored = 0
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise RouteToolError(f"cannot read ({exc.strerror or exc})", path=path, fix="check the path") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"line {lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8").strip()
            except UnicodeDecodeError as exc:
                raise RouteToolError(f"{where}: not UTF-8 text (byte {exc.start + 1} of the line is {raw[exc.start]:#04x})",
                                     path=path, fix="JSON lines are UTF-8 text; check the file and --format") from None
            if not line:
                continue
            try:
                obj = loads(line)
            except JSONProblem as exc:
                raise exc.error(path, where=where, fix="one JSON object per line (JSON Lines)") from None
            if not isinstance(obj, dict):
                raise RouteToolError(f"{where}: not a JSON object", path=path, fix="one JSON object per line")
            if obj.get("type") == "meta":
                for k in _META_NUMBERS:
                    if obj.get(k) is not None and meta.get(k) is not None and obj[k] != meta[k]:
                        raise RouteToolError(f"{where}: meta row says {k}={_short(obj[k])} but an earlier meta row "
                                             f"said {_short(meta[k])}", path=path,
                                             fix="read dumps of one model at a time, or pass the value as an option")
                meta.update(obj)
                continue
            id_key = _one_key(obj, _ID_KEYS, "expert ids", where, path)
            if id_key is None:
                ignored += 1
                continue
            ids = obj[id_key]
            w_key = _one_key(obj, _WEIGHT_KEYS, "weights", where, path)
            weights = obj.get(w_key) if w_key else None
            layer_key = _one_key(obj, _LAYER_KEYS, "layer", where, path)
            layer = _layer_index(obj[layer_key], where, layer_key, path, text=False) if layer_key else 0
            if not isinstance(ids, list):
                raise RouteToolError(f"{where}: {id_key} is {_short(ids)}, not a list of expert ids", path=path,
                                     fix="fix the row")
            batch = bool(ids) and isinstance(ids[0], list)
            token_rows = [_json_ids(r, where, id_key, path) for r in ids] if batch else [_json_ids(ids, where, id_key, path)]
            weight_rows = None
            if weights is not None and weights != []:
                if batch:
                    if not isinstance(weights, list) or len(weights) != len(token_rows):
                        raise RouteToolError(f"{where}: {w_key} does not hold one list of weights per token row of "
                                             f"{id_key}", path=path, fix="fix the row")
                    weight_rows = [_json_weights(w, where, w_key, path) for w in weights]
                else:
                    weight_rows = [_json_weights(weights, where, w_key, path)]
            step_key_name = _one_key(obj, _STEP_KEYS, "step", where, path)
            req = tuple(obj.get(k) for k in _REQUEST_KEYS)
            tok_key = _one_key(obj, _TOKEN_KEYS, "token index", where, path)
            tok = None
            if tok_key is not None and obj[tok_key] is not None:
                tok = _as_int(obj[tok_key], text=False)
                if _json_string_number(obj[tok_key]):
                    raise RouteToolError(f"{where}: {tok_key}={_short(obj[tok_key])} is a string, not a JSON number",
                                         path=path, fix=f"write {tok_key} as a number, without quotes")
                if tok is None:
                    raise RouteToolError(f"{where}: {tok_key}={_short(obj[tok_key])} is not an integer", path=path,
                                         fix="fix the row")
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
            for i, row_ids in enumerate(token_rows):
                yield _Row(layer, row_ids, weight_rows[i] if weight_rows else None, (file_tag, counter), where)
    if ignored:
        notes.append(f"{path.name}: ignored {ignored:,} lines without expert ids")


def _meta_int(meta: dict, path: Path, *keys: str) -> int | None:
    given = [k for k in keys if meta.get(k) is not None]  # e.g. top_k and num_experts_per_tok
    for k in given[1:]:
        if meta[k] != meta[given[0]]:
            raise RouteToolError(f"meta row: {given[0]}={_short(meta[given[0]])} and {k}={_short(meta[k])} disagree",
                                 path=path, fix="fix the meta row, or pass the value as an option")
    for k in keys:
        if k in meta and meta[k] is not None:
            if _json_string_number(meta[k]):
                raise RouteToolError(f"meta row: {k}={_short(meta[k])} is a string, not a JSON number", path=path,
                                     fix=f"write {k} as a number ({_as_int(meta[k])}, without quotes)")
            value = _as_int(meta[k], text=False)
            if value is None or not 1 <= value <= MAX_EXPERTS:
                raise RouteToolError(f"meta row: {k}={_short(meta[k])} is not an integer in [1, {MAX_EXPERTS:,}]",
                                     path=path, fix="fix the meta row, or pass the value as an option")
            return value
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
    result = _assemble(rows, path, "jsonl", options, model,
                       None if options.num_experts else _meta_int(meta, path, "num_experts", "n_experts"),
                       None if options.topk else _meta_int(meta, path, "top_k", "topk", "num_experts_per_tok"), notes,
                       input_bytes(files))
    return _finish(result, read, skipped, dropped, runs, options)


# ---------------------------------------------------------------------------------------
# CSV
def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.strip().lower()).strip("_")


def _utf8_lines(fh, path: Path) -> Iterator[str]:
    """The lines of a binary file as text, failing on the first line that is not UTF-8."""
    for lineno, raw in enumerate(fh, 1):
        try:
            yield raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise RouteToolError(f"line {lineno}: not UTF-8 text (byte {exc.start + 1} of the line is "
                                 f"{raw[exc.start]:#04x})", path=path,
                                 fix="save the dump as UTF-8 text, or check --format") from None


_CLOSING = {"[": "]", "(": ")"}


def _csv_numbers(text: str, kind, what: str, where: str, column: str, path: Path) -> list:
    """Numbers of a list field such as ``"[8, 26, 56]"`` (commas, semicolons, spaces separate): expert
    ids (``kind`` int) or weights (``kind`` float; finite and >= 0, see :func:`_check_weight`).

    The list is bare (``8 26 56``) or in one pair of brackets (``[...]`` or ``(...)``); a list
    opened and not closed (``"[1, 2"``: a cell cut short, or a quote that swallowed the next
    line), closed and not opened, or with brackets inside, is an error.
    """
    out = []
    body = text.strip()
    if "\n" in body or "\r" in body:  # a quote opened in this cell ran on into the next line(s)
        raise RouteToolError(f"{where}: the {column!r} cell runs over {body.count(chr(10)) + 1} lines (its quote is not "
                             f"closed where the line ends)", path=path,
                             fix="close the quote of the cell; a dump cut short has lost rows, so re-export it")
    for tok in _CSV_SPLIT.split(body):
        if not tok:
            continue
        if kind is int:
            value = parse_int(tok)
            if value is None:
                raise RouteToolError(f"{where}: {what} {tok!r} in {column!r} is not an integer", path=path,
                                     fix="expert ids are integers; fix the row")
            out.append(value)
        else:
            value = parse_float(tok, special=True)
            if value is None:
                raise RouteToolError(f"{where}: {what} {tok!r} in {column!r} is not a number", path=path,
                                     fix="fix the row")
            out.append(_check_weight(value, repr(tok), where, column, path))
    shown = " ".join(body.split())
    shown = repr(shown if len(shown) <= 40 else shown[:37] + "...")
    inner = body
    if body[:1] in _CLOSING:
        if not body.endswith(_CLOSING[body[0]]):
            raise RouteToolError(f"{where}: the list {shown} in {column!r} is not closed (it opens with {body[0]!r} "
                                 f"but does not end with {_CLOSING[body[0]]!r})", path=path,
                                 fix="close the list, e.g. \"[1, 2, 3]\"; a cell cut short has lost ids, so "
                                     "re-export the dump")
        inner = body[1:-1]
    if re.search(r"[\[\]()]", inner):
        raise RouteToolError(f"{where}: the list {shown} in {column!r} has unbalanced or nested brackets", path=path,
                             fix="write one flat list per cell, e.g. \"[1, 2, 3]\"")
    return out


def read_csv(path: Path, options: ImportOptions) -> ImportedRouting:
    """Read a CSV routing dump, or a folder of CSV files. See the module docstring."""
    files = sorted((p for p in path.iterdir() if p.suffix.lower() in (".csv", ".tsv")), key=_natural_key) \
        if path.is_dir() else [path]
    rows: list[_Row] = []
    notes: list[str] = []
    spellings: dict[int, tuple[str, str]] = {}  # layer -> its first spelling ("0" and "00" are one layer)
    for file_no, f in enumerate(files):
        try:
            fh = open(f, "rb")
        except OSError as exc:
            raise RouteToolError(f"cannot read ({exc.strerror or exc})", path=f, fix="check the path") from None
        with fh:
            reader = csv.reader(_utf8_lines(fh, f), delimiter="\t" if f.suffix.lower() == ".tsv" else ",")
            try:
                header = next(reader)
            except StopIteration:
                continue
            except csv.Error as exc:
                raise RouteToolError(f"not a CSV file ({one_line(exc)})", path=f, fix="pass a CSV with a header row") from None
            names = [_norm(h) for h in header]

            def col(candidates, field, names=names, header=header, f=f):
                hits = [i for i, n in enumerate(names) if n in candidates]
                if len(hits) > 1:  # two columns for one field: never pick one silently
                    raise RouteToolError(f"line 1: the columns {header[hits[0]]!r} and {header[hits[1]]!r} both give "
                                         f"the {field}", path=f,
                                         fix="keep one of them (rename or drop the other column)")
                return hits[0] if hits else None

            c_ids, c_w = col(_CSV_IDS, "expert ids"), col(_CSV_WEIGHTS, "weights")
            c_layer, c_step = col(_CSV_LAYER, "layer"), col(_CSV_STEP, "step")
            if c_ids is None:
                raise RouteToolError(f"no expert-id column in the header {header}", path=f,
                                     fix="name it 'Activated Expert IDs', 'topk_ids' or 'expert_ids'")
            try:
                for rec in reader:
                    lineno = reader.line_num
                    if not rec:
                        continue
                    where = f"line {lineno}"
                    if len(rec) != len(header):
                        raise RouteToolError(f"{where}: {len(rec)} fields, header has {len(header)}", path=f,
                                             fix="quote fields that contain commas")
                    ids = tuple(_csv_numbers(rec[c_ids], int, "expert id", where, header[c_ids], f))
                    weights = None
                    if c_w is not None and rec[c_w].strip():
                        weights = tuple(_csv_numbers(rec[c_w], float, "weight", where, header[c_w], f))
                    layer = _layer_index(rec[c_layer], where, header[c_layer], f, spellings,
                                         label=f"{f.name} {where}" if f != path else where) \
                        if c_layer is not None else 0
                    step = rec[c_step] if c_step is not None else None
                    rows.append(_Row(layer, ids, weights, (file_no, step),
                                     f"{f.name} line {lineno}" if f != path else where))  # (errors name path)
            except csv.Error as exc:
                raise RouteToolError(f"malformed CSV ({one_line(exc)})", path=f, fix="fix the file") from None
    if len(files) > 1:
        notes.append(f"read {len(files)} CSV files; each file's batches are separate steps")
    read = len(rows)
    rows, skipped, dropped, runs = _filter_rows(rows, options)
    model = options.model or path.stem
    result = _assemble(rows, path, "csv", options, model, None, None, notes, input_bytes(files))
    return _finish(result, read, skipped, dropped, runs, options)


# ---------------------------------------------------------------------------------------
# SGLang expert-distribution dumps
def _where(name: str, index) -> str:
    return f"{name}[{', '.join(str(int(i)) for i in index)}]"


def _int_tensor(value, name: str, path: Path, *, low: int, high: int, what: str) -> torch.Tensor:
    """``value`` as an int64 tensor of integers in ``[low, high)``, or a one-line error naming
    the first bad element (non-numeric, non-finite, fractional or out of range)."""
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise RouteToolError(f"{name} is not a numeric tensor ({one_line(exc, 80)})", path=path,
                             fix="pass an unmodified SGLang dump") from None
    if t.dtype == torch.bool or t.is_complex():
        raise RouteToolError(f"{name} has dtype {t.dtype}; expected integer {what}", path=path,
                             fix="pass an unmodified SGLang dump")
    if t.is_floating_point():
        t64 = t.double()
        bad = ~torch.isfinite(t64) | (t64 != t64.round())
        if bad.any():
            idx = bad.nonzero()[0].tolist()
            raise RouteToolError(f"{_where(name, idx)} is {float(t64[tuple(idx)])!r}: {what} must be finite integers",
                                 path=path, fix="pass an unmodified SGLang dump")
        out_of_range = (t64 < low) | (t64 >= high)
        if out_of_range.any():
            idx = out_of_range.nonzero()[0].tolist()
            raise RouteToolError(f"{_where(name, idx)} is {float(t64[tuple(idx)])!r}: {what} must lie in [{low}, {high:,})",
                                 path=path, fix="pass an unmodified SGLang dump")
        return t64.long()
    t = t.long()
    bad = (t < low) | (t >= high)
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        v = int(t[tuple(idx)])
        why = "counts cannot be negative" if low == 0 and v < 0 and "count" in what else f"{what} must lie in [{low}, {high:,})"
        raise RouteToolError(f"{_where(name, idx)} is {v}: {why}", path=path, fix="pass an unmodified SGLang dump")
    return t


def _phys_to_log(path: Path, obj: dict, num_layers: int, num_physical: int) -> tuple[torch.Tensor, bool]:
    m = obj.get("last_physical_to_logical_map")
    if m is None:
        return torch.arange(num_physical).repeat(num_layers, 1), False
    m = _int_tensor(m, "last_physical_to_logical_map", path, low=0, high=MAX_EXPERTS, what="logical expert ids")
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
            raise RouteToolError("not an SGLang expert-distribution dump (no 'records' or 'logical_count') nor a "
                                 "Megatron RouterReplay recording (top_k_idx tensors)", path=f,
                                 fix="dump with /dump_expert_distribution_record, or pick another --format")
    notes: list[str] = []
    model = options.model or path.stem
    if all("logical_count" in obj for _, obj in objs):
        _refuse_counts(path, options)
        check_options_read(path, options, COUNTS_OPTIONS, "an sglang stat dump of per-expert counts")
        return _sglang_stat(path, objs, options, model, notes)
    if any("logical_count" in obj for _, obj in objs):
        raise RouteToolError("the folder mixes stat and per-pass dumps", path=path, fix="read one mode at a time")
    records = []
    maps = {}
    for f, obj in objs:
        if not isinstance(obj["records"], list):
            raise RouteToolError("'records' is not a list", path=f, fix="pass an unmodified SGLang dump")
        for i, r in enumerate(obj["records"]):
            if not isinstance(r, dict) or "forward_pass_id" not in r:
                raise RouteToolError(f"records[{i}] lacks forward_pass_id", path=f, fix="pass an unmodified SGLang dump")
            fp, rank = _as_int(_scalar(r["forward_pass_id"])), _as_int(_scalar(r.get("rank", 0)))
            if fp is None or rank is None:
                raise RouteToolError(f"records[{i}]: forward_pass_id / rank are not integers", path=f,
                                     fix="pass an unmodified SGLang dump")
            if "topk_ids_of_layer" not in r and "global_physical_count" not in r:
                raise RouteToolError(f"records[{i}] holds neither topk_ids_of_layer nor global_physical_count", path=f,
                                     fix="pass an unmodified SGLang dump")
            records.append((fp, rank, f, r))
        maps[f] = obj
    if not records:
        raise RouteToolError("holds no records", path=path, fix="record some traffic before dumping")
    records.sort(key=lambda x: (x[0], x[1]))
    if all("topk_ids_of_layer" in r for *_, r in records):
        return _sglang_per_token(path, records, maps, options, model, notes)
    _refuse_counts(path, options)
    check_options_read(path, options, COUNTS_OPTIONS, "an sglang per-pass dump of per-expert counts")
    return _sglang_per_pass(path, records, maps, options, model, notes)


def _scalar(value):
    """A 0-d tensor as a Python number (SGLang stores some ids as tensors); anything else as is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def _sglang_stat(path: Path, objs, options: ImportOptions, model: str, notes: list[str]) -> ImportedCounts:
    chunks = []
    for f, obj in objs:
        lc = _int_tensor(obj["logical_count"], "logical_count", f, low=0, high=MAX_COUNT, what="expert counts")
        if lc.dim() == 2:
            lc = lc[None]
        if lc.dim() != 3 or lc.shape[2] == 0:
            raise RouteToolError(f"logical_count has shape {list(lc.shape)}; expected [steps, layers, experts]",
                                 path=f, fix="pass an unmodified SGLang dump")
        if lc.shape[2] > MAX_EXPERTS:
            raise RouteToolError(f"logical_count has {lc.shape[2]:,} experts (at most {MAX_EXPERTS:,})", path=f,
                                 fix="pass an unmodified SGLang dump")
        chunks.append(lc)
    if len({c.shape[1:] for c in chunks}) > 1:
        raise RouteToolError(f"the dumps' logical_count shapes differ ({sorted({tuple(c.shape[1:]) for c in chunks})})",
                             path=path, fix="read dumps of one model and run together")
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
    size = input_bytes(maps)
    for fp, _rank, f, r in records:
        if r.get("global_physical_count") is None:
            raise RouteToolError(f"forward pass {fp}: a record lacks global_physical_count", path=f,
                                 fix="pass an unmodified SGLang dump")
        g = _int_tensor(r["global_physical_count"], f"forward pass {fp}: global_physical_count", f, low=0,
                        high=MAX_COUNT, what="expert counts")
        if g.dim() != 2 or g.shape[1] == 0:
            raise RouteToolError("a record's global_physical_count is not [layers, physical experts]", path=f,
                                 fix="pass an unmodified SGLang dump")
        m, _ = _phys_to_log(f, maps[f], g.shape[0], g.shape[1])
        map_experts = int(m.max()) + 1
        if options.num_experts is not None and map_experts > options.num_experts:
            raise RouteToolError(f"last_physical_to_logical_map names expert {map_experts - 1} >= --num-experts "
                                 f"{options.num_experts}", path=f, fix="fix --num-experts")
        E = max(E or 0, options.num_experts or map_experts)
        check_expert_tables(path, experts=E, layer_steps=g.shape[0] * (len(steps) + 1), layers=g.shape[0], size=size,
                            fix="pass the model's --num-experts" if options.num_experts else
                                "last_physical_to_logical_map sets num_experts: pass an unmodified SGLang dump")
        logical = torch.zeros(g.shape[0], E, dtype=torch.int64).scatter_add_(1, m, g)
        prev = steps.get(fp)
        if prev is not None and prev.shape != logical.shape:
            if prev.shape[0] != logical.shape[0]:
                raise RouteToolError(f"forward pass {fp}: records disagree on the number of layers", path=f,
                                     fix="read dumps of one model and run together")
            wider = torch.zeros_like(logical) if prev.shape[1] < logical.shape[1] else torch.zeros_like(prev)
            wider[:, : prev.shape[1]] += prev
            wider[:, : logical.shape[1]] += logical
            steps[fp] = wider
        else:
            steps[fp] = logical if prev is None else prev + logical
    if len({s.shape[0] for s in steps.values()}) > 1:
        raise RouteToolError("the records disagree on the number of layers", path=path,
                             fix="read dumps of one model and run together")
    stacked = torch.stack([torch.nn.functional.pad(steps[k], (0, E - steps[k].shape[1])) for k in sorted(steps)])
    layers = {layer: stacked[:, layer].clone() for layer in range(stacked.shape[1]) if stacked[:, layer].sum() > 0}
    if not layers:
        raise RouteToolError("every record's global_physical_count is zero", path=path,
                             fix="record some traffic before dumping")
    notes.append("SGLang per-pass dump: per-step expert counts (physical counts mapped to logical experts)")
    return ImportedCounts(source=str(path), format="sglang", model=model, num_experts=E, topk=options.topk,
                          layers=layers, notes=notes)


def _sglang_per_token(path: Path, records, maps, options, model, notes) -> ImportedRouting:
    rows: list[_Row] = []
    mapped = False
    for fp, rank, f, r in records:
        # [L, n, 8] physical ids, -1 unused
        ids = _int_tensor(r["topk_ids_of_layer"], f"forward pass {fp}: topk_ids_of_layer", f, low=-1,
                          high=MAX_EXPERTS, what="physical expert ids (-1 unused)")
        if ids.dim() != 3:
            raise RouteToolError("a record's topk_ids_of_layer is not [layers, tokens, k]", path=f,
                                 fix="pass an unmodified SGLang dump")
        if ids.numel() == 0:
            continue
        L = ids.shape[0]
        m_obj = maps[f].get("last_physical_to_logical_map")
        num_phys = int(torch.as_tensor(m_obj).shape[1]) if m_obj is not None and torch.as_tensor(m_obj).dim() == 2 \
            else int(ids.max()) + 1
        m, has_map = _phys_to_log(f, maps[f], L, max(num_phys, 1))
        mapped |= has_map
        valid = ids >= 0
        if int(ids.max()) >= m.shape[1]:
            raise RouteToolError(f"forward pass {fp}: physical id {int(ids.max())} outside the map", path=f,
                                 fix="pass an unmodified SGLang dump")
        logical = torch.where(valid, torch.gather(m, 1, ids.clamp(min=0).flatten(1)).view_as(ids), -1)
        positions = r.get("positions")  # the recorder's ForwardBatch.positions: each token's position in its request
        if not (isinstance(positions, (list, tuple)) and len(positions) == ids.shape[1]
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in positions)):
            positions = [None] * ids.shape[1]
        for layer in range(L):
            for t in range(ids.shape[1]):
                row = [int(x) for x in logical[layer, t].tolist() if x >= 0]
                if row:
                    where = f"pass {fp} layer {layer} token {t}"
                    rows.append(_Row(layer, tuple(row), None, (fp,), f"{f.name} {where}" if f != path else where,
                                     positions[t]))
    if mapped:
        notes.append("physical expert ids mapped to logical experts with last_physical_to_logical_map")
    read = len(rows)
    rows.sort(key=lambda r: r.layer)  # stable: keeps pass and token order within a layer
    rows, skipped, dropped, runs = _filter_rows(rows, options)
    E = options.num_experts
    if E is None:
        ms = [_int_tensor(o["last_physical_to_logical_map"], "last_physical_to_logical_map", Path(str(f)), low=0,
                          high=MAX_EXPERTS, what="logical expert ids")
              for f, o in maps.items() if o.get("last_physical_to_logical_map") is not None]
        ms = [x for x in ms if x.numel()]
        E = int(max(int(x.max()) for x in ms)) + 1 if ms else None
    result = _assemble(rows, path, "sglang", options, model, E, None, notes, input_bytes(maps))
    return _finish(result, read, skipped, dropped, runs, options)


# ---------------------------------------------------------------------------------------
# counts JSON
def _is_int(s) -> bool:
    """A key that is an integer in plain ASCII decimal (``"7"``, ``"-1"``, ``"07"``)."""
    return parse_int(s) is not None


def _loose_int(s) -> bool:
    """A key Python's int() reads but that is not plain ASCII decimal (``"1_0"``, ``" 1"``, Arabic-Indic digits)."""
    try:
        int(s)
    except (TypeError, ValueError):
        return False
    return not _is_int(s)


def _check_keys(node: dict, where: str, path: Path, what: str) -> None:
    """Integer keys of one object: plain ASCII decimal, and one spelling per number (``"0"`` and
    ``"00"`` in one object would be one layer or expert, the later value silently replacing the other)."""
    seen: dict[int, str] = {}
    for k in node:
        if _loose_int(k):
            raise RouteToolError(f"{where}: key {k!r} is not a plain decimal {what} (ASCII digits 0-9 only)", path=path,
                                 fix="write the key in ASCII digits without underscores or spaces")
        if _is_int(k):
            n = int(k)
            if n in seen:
                raise RouteToolError(f"{where}: keys {seen[n]!r} and {k!r} name the same {what} {n}", path=path,
                                     fix=f"keep one key per {what} (e.g. {n}), with all of its counts")
            seen[n] = k


def _counts_vector(value, where: str, path: Path) -> dict[int, int]:
    if isinstance(value, dict):
        _check_keys(value, where, path, "expert")
    if isinstance(value, list):
        if len(value) > MAX_EXPERTS:
            raise RouteToolError(f"{where}: {len(value):,} counts (at most {MAX_EXPERTS:,} experts)", path=path,
                                 fix="fix the file")
        items = enumerate(value)
    elif isinstance(value, dict) and all(_is_int(k) for k in value):
        items = ((int(k), v) for k, v in value.items())
    else:
        raise RouteToolError(f"{where}: expected {{expert_id: count}} or a list of counts", path=path, fix="fix the file")
    out = {}
    for e, c in items:
        if not 0 <= e < MAX_EXPERTS:
            raise RouteToolError(f"{where}: expert id {e} is out of range [0, {MAX_EXPERTS:,})", path=path,
                                 fix="fix the file")
        if isinstance(c, bool) or not isinstance(c, (int, float)):
            raise RouteToolError(f"{where}: expert {e} count {_short(c)} is not a non-negative integer", path=path,
                                 fix="fix the file")
        if isinstance(c, float) and not math.isfinite(c):
            raise RouteToolError(f"{where}: expert {e} count {_short(c)} is not a finite number", path=path,
                                 fix="fix the file: counts are non-negative integers")
        if c < 0 or c != int(c):
            raise RouteToolError(f"{where}: expert {e} count {_short(c)} is not a non-negative integer", path=path,
                                 fix="fix the file")
        if c >= MAX_COUNT:
            raise RouteToolError(f"{where}: expert {e} count {_short(c)} is too large (at most {MAX_COUNT - 1:,})",
                                 path=path, fix="fix the file")
        out[e] = int(c)
    return out


def _layer_key(k: str, where: str, path: Path) -> int:
    layer = int(k)
    if not 0 <= layer < MAX_LAYERS:
        raise RouteToolError(f"{where}: layer {k!r} is not a layer index (an integer in [0, {MAX_LAYERS:,}))",
                             path=path, fix="fix the file")
    return layer


def _layer_tables(node, names: tuple[str, ...], path: Path) -> Iterator[tuple[tuple[str, ...], dict]]:
    if isinstance(node, dict):
        _check_keys(node, "/".join(names) or "top level", path,
                    "expert" if all(isinstance(v, (int, float)) for v in node.values()) else "layer")
    if isinstance(node, dict) and node and all(_is_int(k) for k in node):
        vals = list(node.values())
        if all(isinstance(v, (dict, list)) for v in vals):
            where = "/".join(names) or "top level"
            as_list = [k for k, v in node.items() if isinstance(v, list)]
            as_map = [k for k, v in node.items() if isinstance(v, dict)]
            if as_list and as_map:  # a map's experts beyond its largest id used to be padded with zeros
                raise RouteToolError(f"{where}: layer {as_list[0]} is a list of counts but layer {as_map[0]} a "
                                     "{expert_id: count} map: one table must use one form", path=path,
                                     fix="give every layer a list of one count per expert, or every layer a map")
            lengths = {k: len(v) for k, v in node.items() if isinstance(v, list)}
            if len(set(lengths.values())) > 1:  # a list holds one count per expert: its length is E
                first = next(iter(lengths))
                odd = next(k for k, n in lengths.items() if n != lengths[first])
                raise RouteToolError(f"{where}: layer {odd} lists {lengths[odd]} expert counts, layer {first} "
                                     f"{lengths[first]}", path=path,
                                     fix="give every layer one count per expert (or {expert_id: count} maps)")
            yield names, {_layer_key(k, where, path): _counts_vector(v, "/".join(names + (str(k),)), path)
                          for k, v in node.items()}
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
    doc = load_file(path, fix="save it as UTF-8 JSON of per-expert counts, or check --format")
    tables = list(_layer_tables(doc, (), path))
    tables = [(n, t) for n, t in tables if any(t.values())]
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
    groups = sorted({n[0] if len(n) > 1 else "" for n, _ in tables})
    several = options.num_experts is None and len(set(widths.values())) > 1
    models = [g for g in groups if g]
    choose = f"--select {shlex.quote(models[0])}" if models else "--select NAME"
    known = f"; the file holds several models: {', '.join(models[:4])}" + (", ..." if len(models) > 4 else "")
    # (before the models' E is asked for; the command pastes as it stands)
    _refuse_counts(path, options, f" {choose}{known}" if several else "")
    if several:
        raise RouteToolError(f"the tables have different expert counts ({sorted(set(widths.values()))}): "
                             "several models in one file", path=path, fix=f"choose one with {choose}{known}")
    if max(widths.values()) > E:
        raise RouteToolError(f"expert id {max(widths.values()) - 1} >= --num-experts {E}", path=path,
                             fix="fix --num-experts")
    all_layers = sorted({layer for _, t in tables for layer in t})
    check_expert_tables(path, experts=E, layer_steps=len(tables) * len(all_layers), layers=len(all_layers),
                        size=input_bytes([path]),
                        fix="pass the model's --num-experts" if options.num_experts else
                            f"the largest expert id, {E - 1}, sets num_experts: fix the counts, or --select the "
                            "tables of one model")
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
def resolve_format(path: str | Path, fmt: str = "auto") -> str:
    """The reader for ``path``: ``detect_format`` for ``auto``; an explicit ``fmt`` is checked
    against what the file clearly is (a routetool trace or not).

    Raises:
        RouteToolError: missing path; a FIFO, device or socket (also as a dump file of a
            folder); ``--format trace`` for a file that is not a trace; a dump
            format for a file that is a trace; nothing recognisable.
    """
    path = Path(path)
    if fmt == "auto":
        return detect_format(path)
    if fmt not in FORMATS:
        raise RouteToolError(f"unknown format {fmt!r}", fix=f"use one of {', '.join(FORMATS)}")
    require_input(path, what="file or folder")
    _refuse_special_files(path)
    detected = _detected(path)
    if fmt == "trace" and detected != "trace":
        looks = f" (its content looks like {detected})" if detected else ""
        raise RouteToolError(f"--format trace does not match: this is not a routetool trace{looks}", path=path,
                             fix="drop --format to detect the format, or pass the file's format")
    if fmt != "trace" and detected == "trace":
        raise RouteToolError(f"--format {fmt} does not match: this is a routetool trace, not a {fmt} dump", path=path,
                             fix="drop --format")
    return fmt


def check_import_options(options: ImportOptions) -> None:
    """Bounds on the options (one-line errors instead of absurd allocations).

    Raises:
        RouteToolError: ``num_experts`` / ``topk`` outside ``[1, MAX_EXPERTS]``, negative filters.
    """
    for name, value in (("--num-experts", options.num_experts), ("--topk", options.topk)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1 <= value <= MAX_EXPERTS):
            raise RouteToolError(f"{name} {value} is out of range: at most {MAX_EXPERTS:,} experts are supported",
                                 fix=f"pass the model's {name} (between 1 and {MAX_EXPERTS:,})")
    if options.num_experts is not None and options.topk is not None and options.topk > options.num_experts:
        raise RouteToolError(f"--topk {options.topk} > --num-experts {options.num_experts}",
                             fix="a token picks at most num_experts experts")
    if options.skip_rows < 0 or options.drop_repeats < 0:
        raise RouteToolError("--skip-rows and --drop-repeats must be >= 0", fix="e.g. --skip-rows 0")


def check_options_read(path: Path, options: ImportOptions, read: Iterable[str], what: str) -> None:
    """Refuse the reading options given for a dump that does not use them (never ignored silently).

    ``read``: the options the dump's reader uses (keys of :data:`READING_OPTIONS`); ``what``:
    the dump, as the message names it (``a jsonl dump``).

    Raises:
        RouteToolError: naming the options given in vain, the dump's format and the options it reads.
    """
    defaults = ImportOptions()
    given = [name for name in READING_OPTIONS
             if (name in options.given if options.given is not None
                 else getattr(options, name) != getattr(defaults, name))]
    unused = [READING_OPTIONS[name] for name in given if name not in read]
    if unused:
        flags = ", ".join(unused)
        raise RouteToolError(f"{flags} {'do' if len(unused) > 1 else 'does'} not apply to {what} (it reads "
                             f"{', '.join(READING_OPTIONS[name] for name in read)})", path=path, fix=f"drop {flags}")


def read_dump(path: str | Path, options: ImportOptions | None = None, *,
              classified: str | None = None) -> ImportedRouting | ImportedCounts:
    """Read any supported routing dump (not a trace).

    ``classified``: the format :func:`routetool.io.inputs.classify` found for ``path``
    (``InputPath.format``), which is then read as such, without detecting it again; None:
    ``options.format`` (``auto``: detected here).

    Returns:
        :class:`ImportedRouting` for per-token ids, :class:`ImportedCounts` for counts.

    Raises:
        RouteToolError: unknown format, a trace, a reading option the format does not use
            (:func:`check_options_read`), a dump of per-expert counts where
            ``options.refuse_counts`` asks for per-token ids, malformed rows (naming the file and line),
            numbers that are not what they must be (non-integer or out-of-range ids and layers,
            negative or non-finite counts), E/K contradictions (``topk`` above the expert
            count a counts file holds included). Any other parse failure of the
            file is reported in one line as well, never as a traceback.
    """
    options = options or ImportOptions()
    path = Path(path)
    check_import_options(options)
    explicit = options.format != "auto"
    fmt = classified if classified is not None else resolve_format(path, options.format)
    if fmt == "trace":
        raise RouteToolError("is already a routetool trace: `import` reads routing dumps", path=path,
                             fix="analyse it with `routetool balance`")
    readers = {"jsonl": read_jsonl, "csv": read_csv, "sglang": read_sglang, "counts-json": read_counts_json,
               "vllm": read_vllm, "sglang-routed": read_sglang_routed, "megatron": read_megatron,
               "megatron-ep-load": read_megatron_ep_load, "flashinfer-trace": read_flashinfer}
    if fmt not in readers:
        raise RouteToolError(f"unknown format {fmt!r}", fix=f"use one of {', '.join(FORMATS)}")
    if not (fmt in ("counts-json", "megatron-ep-load") and options.refuse_counts is not None):  # (refused as counts)
        check_options_read(path, options, OPTIONS_READ[fmt], {"sglang": "an sglang dump",
                                                              "counts-json": "a counts-json file of per-expert counts"}
                           .get(fmt, f"a {fmt} dump"))
    try:
        result = readers[fmt](path, options)
    except RouteToolError:
        raise
    except OSError as exc:
        raise RouteToolError(f"cannot read ({exc.strerror or one_line(exc, 100)})", path=exc.filename or path,
                             fix="check the path and permissions") from None
    except (UnicodeDecodeError, ValueError, OverflowError, TypeError, KeyError, IndexError, RuntimeError,
            RecursionError, EOFError, zipfile.BadZipFile) as exc:
        how = f"--format {fmt}" if explicit else f"{fmt} (detected)"
        raise RouteToolError(f"cannot read as {how} ({type(exc).__name__}: {one_line(exc, 100)})", path=path,
                             fix="check the file, or pass its --format") from None
    if isinstance(result, ImportedCounts) and result.topk is not None and result.topk > result.num_experts:
        # (with --num-experts, check_import_options refused this already: here E comes from the file)
        how = "inferred from the counts (largest expert id + 1)" if fmt == "counts-json" else "of the dump's counts"
        raise RouteToolError(f"--topk {result.topk} is more than the {result.num_experts} experts {how}", path=path,
                             fix=f"pass the model's --topk (at most {result.num_experts}), or --num-experts if the "
                                 "model has experts the file never names")
    return result


def write_imported_trace(imported: ImportedRouting, out: str | Path, *, force: bool = False) -> Path:
    """Write per-token routing as a trace (docs/trace-format.md): ids-only, or with logits
    (``gating_output``, ``bias``) for the formats that hold them.

    The router parameters other than E and K are unknown for an ids dump; the trace records
    ``route_scale=1`` as a placeholder and says so in ``router_parameters``. A dump with logits
    carries its router (:attr:`ImportedRouting.router`).

    Raises:
        RouteToolError: as :func:`routetool.io.trace.write_trace` (existing file without
            ``force`` ...).
    """
    extra = {
        "import_format": imported.format,
        "import_rows_dropped": str(imported.rows_dropped),
        "import_rows_skipped": str(imported.rows_skipped),
    }
    if imported.router is None:
        extra["router_parameters"] = "unknown (ids-only import: only num_experts and topk are real)"
    meta = TraceMeta(
        model=imported.model,
        router=imported.router or RouterConfig(num_experts=imported.num_experts, topk=imported.topk, route_scale=1.0),
        provenance=f"routetool import of {imported.source} ({imported.format}); " + "; ".join(imported.notes),
        extra=extra,
    )
    from routetool.engine.stream import check_step_sizes

    E = meta.router.num_experts
    for layer, x in imported.layers.items():  # logits no kernel could be given a step of are not written
        if x.gating_output is not None:  # (ids are read in pieces, whatever a step's size)
            check_step_sizes([b - a for a, b in zip(x.step_offsets, x.step_offsets[1:])], 4 * E,
                             f"{E:,} experts' float32 scores", path=imported.source, tensor=f"layer {layer}",
                             fix="no forward pass routes that many tokens: import the requests or workloads in "
                                 "smaller steps")
    layers = {
        layer: LayerArrays(
            topk_ids=x.topk_ids.to(torch.int32) if x.topk_ids is not None else None,
            topk_weights=x.topk_weights,
            gating_output=x.gating_output,
            bias=x.bias,
            step_offsets=torch.tensor(x.step_offsets, dtype=torch.int64),
        )
        for layer, x in imported.layers.items()
    }
    return write_trace(out, meta, layers, force=force)
