"""Sharded traces: several trace v1 files plus a JSON index, read as one trace.

Long recordings (:class:`routetool.capture.recorder.RoutingRecorder`) are written as a
sequence of ordinary trace files (*shards*), each a complete, valid trace v1 file, plus an
index file that lists them in order::

    {
      "format": "routetool-trace-index",
      "version": "1",
      "complete": true,                  # false: the recording stopped on an error or is still running
      "stopped_by": "exit",              # exit | max_tokens | error: ... | recorder error: ... | null
      "created_by": "routetool.capture.recorder",
      "shards": [
        {"path": "run-00000.safetensors", "size_bytes": 1048576,
         "num_steps": 12, "first_step": 0, "last_step": 11},
        ...
      ]
    }

Only ``format``, ``version`` (the string ``"1"``) and ``shards[].path`` are required; no object
holds a key twice (JSON readers differ on which value of a repeated key wins); ``shards`` is a non-empty
list; ``path`` is relative to the index's folder (or absolute), names a regular file, and no
file is listed twice. ``size_bytes``, when present, is a non-negative integer checked against
the file, so a replaced or truncated shard is caught before it is read. ``complete``, when
present, is a JSON boolean (``"yes"``, ``"false"``, ``1`` or ``null`` is an error). Every other
key is informational and kept as is.

Reading rules (:class:`ShardedTrace`): a layer's steps are the concatenation of its steps in
every shard that holds the layer, in shard order; all shards must agree on the router
metadata (``num_experts``, ``topk``, ``route_scale``, normalization, multiplier, eps) and on
``weights_semantics``, and, per layer, on the bias, the logits dtype and which recorded
outputs are present. A shard without ``is_padding`` for a layer that other shards pad counts
as unpadded. Any disagreement is a one-line :class:`~routetool.errors.RouteToolError` naming
the shard.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from routetool.errors import RouteToolError
from routetool.io.paths import atomic_write, path_kind, same_file
from routetool.io.jsonstrict import JSONProblem, load_file, loads
from routetool.io.tracefile import LayerInfo, Step, Trace, TraceMeta

INDEX_FORMAT = "routetool-trace-index"
INDEX_VERSION = "1"
_PER_SHARD_META = ("shard", "first_step", "last_step")


def shard_path(index_path: str | os.PathLike, number: int) -> Path:
    """Path of shard ``number`` of the index ``index_path``: ``<stem>-00000.safetensors``
    next to the index (``run.json`` -> ``run-00000.safetensors``)."""
    p = Path(index_path)
    return p.with_name(f"{p.stem}-{number:05d}.safetensors")


def looks_like_index(path: str | os.PathLike) -> bool:
    """True when ``path`` names a sharded-trace index rather than a safetensors file.

    By suffix (``.json``) or by content: an index is JSON text, while a safetensors file
    starts with an 8-byte little-endian header length whose high bytes are zero.
    """
    p = Path(path)
    if p.suffix.lower() == ".json":
        return True
    try:
        with open(p, "rb") as fh:
            head = fh.read(64)
    except OSError:
        return False
    return head.lstrip().startswith(b"{") and b"\x00" not in head


def listed_shard_files(path: str | os.PathLike) -> list[Path]:
    """The shard files an index lists (relative paths resolved against the index's folder).

    Best effort, for protecting inputs: anything that is not a readable index (a safetensors
    file, a missing or broken index) lists nothing; reading a trace reports such problems.
    """
    p = Path(path)
    if path_kind(p) != "file" or not looks_like_index(p):
        return []
    try:
        doc = loads(p.read_bytes().decode("utf-8-sig"))
    except (OSError, UnicodeDecodeError, JSONProblem):
        return []
    shards = doc.get("shards") if isinstance(doc, dict) else None
    if not isinstance(shards, list):
        return []
    out = []
    for entry in shards:
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and entry["path"]:
            q = Path(entry["path"])
            out.append(q if q.is_absolute() else p.parent / q)
    return out


def write_index(
    path: str | os.PathLike,
    shards: list[Mapping[str, object]],
    *,
    complete: bool,
    stopped_by: str | None,
    extra: Mapping[str, object] | None = None,
) -> Path:
    """Write (or replace) an index atomically: temporary file in the same folder, then rename.

    Args:
        path: the index file. shards: entries with at least ``path`` (relative to the
            index's folder). complete / stopped_by: how the recording ended (see the module
            docstring). extra: further informational keys.

    Raises:
        RouteToolError: the folder is not writable or the disk is full.
    """
    path = Path(path)
    doc: dict[str, object] = {"format": INDEX_FORMAT, "version": INDEX_VERSION}
    doc.update(extra or {})
    doc.update({"complete": bool(complete), "stopped_by": stopped_by, "shards": [dict(s) for s in shards]})

    def write(tmp: str) -> None:
        with open(tmp, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")

    atomic_write(path, write)
    return path


def read_index(path: str | os.PathLike, display_path: object = None) -> dict:
    """Read and check an index file; returns the parsed document.

    Raises:
        RouteToolError: missing, unreadable or non-regular file, not JSON, a key repeated in
            one object, nesting too deep or a number too long (:mod:`routetool.io.jsonstrict`),
            another format, a ``version`` that is not the string ``"1"``,
            ``complete`` present but not a JSON boolean, ``stopped_by`` neither a string nor
            null, ``shards`` not a non-empty
            list, a shard entry without a path, a ``size_bytes`` that is not a non-negative
            integer, a path listed twice.
    """
    path = Path(path)
    shown = display_path if display_path is not None else path
    kind = path_kind(path, shown=shown)
    if kind in ("missing", "dangling link"):
        raise RouteToolError("no such file", path=shown, fix="check the path")
    if kind == "folder":
        raise RouteToolError("is a directory, not a trace file", path=shown,
                             fix="name a .safetensors trace or a sharded trace's index .json")
    if kind != "file":  # a FIFO, device or socket: reading it could block forever
        raise RouteToolError("is not a regular file (a FIFO, device or socket)", path=shown,
                             fix="name a .safetensors trace or a sharded trace's index .json")
    doc = load_file(path, shown=shown, tensor="index", fix="name a .safetensors trace or a sharded trace's index .json")
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else None
        raise RouteToolError(f"not a routetool trace index (format={found!r}, expected {INDEX_FORMAT!r})",
                             path=shown, tensor="index",
                             fix="name a .safetensors trace or an index written by routetool's recorder")
    version = doc.get("version")
    if not isinstance(version, str):
        found = "absent" if "version" not in doc else f"{_short(version)}, not a string"
        raise RouteToolError(f"\"version\" is {found}: it must be the string \"{INDEX_VERSION}\"", path=shown,
                             tensor="index.version", fix=f"write \"version\": \"{INDEX_VERSION}\", with the quotes")
    if version != INDEX_VERSION:
        raise RouteToolError(f"trace index version {version!r} is not supported (this routetool reads "
                             f"{INDEX_VERSION!r})", path=shown, tensor="index", fix="upgrade routetool")
    if "complete" in doc and not isinstance(doc["complete"], bool):
        # "yes", "false", 0 or null: a string "false" is truthy, so it used to read as a complete recording
        raise RouteToolError(f"\"complete\" is {_short(doc['complete'])}, not a JSON boolean", path=shown,
                             tensor="index.complete",
                             fix="write \"complete\": true (the recording ended normally) or false, without quotes")
    if "stopped_by" in doc and doc["stopped_by"] is not None and not isinstance(doc["stopped_by"], str):
        raise RouteToolError(f"\"stopped_by\" is {_short(doc['stopped_by'])}, not a string or null", path=shown,
                             tensor="index.stopped_by",
                             fix="write how the recording ended as a string (\"exit\", \"max_tokens\", \"error: ...\") "
                                 "or null")
    shards = doc.get("shards")
    if shards is None:
        raise RouteToolError("the index lists no shards (no \"shards\" key)", path=shown, tensor="index.shards",
                             fix="the recording wrote nothing; record again")
    if not isinstance(shards, list):
        raise RouteToolError(f"\"shards\" must be a list of shard entries, not {type(shards).__name__} "
                             f"{_short(shards)}", path=shown, tensor="index.shards",
                             fix="write the index with routetool's recorder (shards: [{\"path\": ...}, ...])")
    if not shards and doc.get("recorded") == "nothing" and isinstance(doc.get("recorded_nothing"), str):
        # the recorder's verdict on a run whose model steps routed nothing through the recorded function
        raise RouteToolError(doc["recorded_nothing"][:400], path=shown, tensor="index.recorded",
                             fix="record the function the engine calls (the recorder's target), in the process "
                                 "that runs the model")
    if not shards:
        raise RouteToolError("the index lists no shards", path=shown, tensor="index.shards",
                             fix="the recording wrote nothing; record again")
    seen: dict[str, int] = {}
    for i, entry in enumerate(shards):
        where = f"index.shards[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not entry["path"]:
            raise RouteToolError(f"shard entry {i} has no path", path=shown, tensor=where,
                                 fix="each shard entry needs a \"path\" string")
        size = entry.get("size_bytes")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise RouteToolError(f"shard {i} ({entry['path']}): size_bytes={_short(size)} is not a byte count",
                                 path=shown, tensor=where,
                                 fix="size_bytes must be a non-negative integer (or absent)")
        key = os.path.normpath(entry["path"])
        if key in seen:
            raise RouteToolError(f"shard {i} ({entry['path']}) is listed twice (also as shard {seen[key]}); its "
                                 "steps would be counted twice", path=shown, tensor=where,
                                 fix="list every shard once")
        seen[key] = i
    return doc


def _short(value: object) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class _Part:
    """Where one shard's rows of one layer sit in the concatenated layer."""

    shard: int
    row_offset: int
    step_offset: int
    num_tokens: int


class ShardedTrace:
    """A sharded trace (index + shard files) with the public interface of
    :class:`routetool.io.trace.Trace`: ``path``, ``display_path``, ``meta``, ``layers``,
    ``info(L)``, ``bias(L)``, ``steps(L)``, ``read_rows(L, start, stop)``,
    ``total_tokens``, ``close()`` and the context manager.

    Also: ``index`` (the parsed index document), ``shards`` (the open shard
    :class:`Trace` objects) and ``shard_paths``.

    Opening reads the index and every shard's header (plus its small per-layer tensors);
    the large tensors are read one step at a time, as with a single file.

    Raises:
        RouteToolError: a bad index, a missing/replaced shard, a bad shard (as
            :class:`Trace` reports it), or shards that disagree (see the module docstring).
    """

    def __init__(self, path: str | os.PathLike, *, display_path: str | os.PathLike | None = None):
        self.path = Path(path)
        self.display_path = Path(display_path) if display_path is not None else self.path
        self.index = read_index(self.path, self.display_path)
        folder = self.path.parent
        self.shard_paths: list[Path] = []
        self.shards: list[Trace] = []
        try:
            index_name = self.display_path.name
            fix = f"keep every shard file next to the index {index_name}"
            for i, entry in enumerate(self.index["shards"]):
                p = Path(entry["path"])
                full = p if p.is_absolute() else folder / p
                shown = full if display_path is None else Path(self.display_path).parent / p
                kind = path_kind(full, shown=shown)
                if kind in ("missing", "dangling link"):
                    raise RouteToolError(f"shard {i} listed in the index {index_name} does not exist", path=shown,
                                         fix=fix)
                if kind == "folder":
                    raise RouteToolError(f"shard {i} listed in the index {index_name} is a directory, not a shard "
                                         "file", path=shown, fix="each shard entry must name a .safetensors file")
                if kind != "file":  # a FIFO, device or socket: reading it could block forever
                    raise RouteToolError(f"shard {i} listed in the index {index_name} is not a regular file (a FIFO, "
                                         "device or socket)", path=shown,
                                         fix="each shard entry must name a .safetensors file")
                for j, other in enumerate(self.shard_paths):
                    if same_file(full, other):
                        raise RouteToolError(f"shard {i} listed in the index {index_name} is the same file as shard "
                                             f"{j}; its steps would be counted twice", path=shown,
                                             fix=f"list every shard once in {index_name}")
                size = entry.get("size_bytes")
                actual = full.stat().st_size
                if size is not None and actual != size:
                    raise RouteToolError(
                        f"shard {i} has {actual} bytes but the index {index_name} says {size}",
                        path=shown, fix="the shard was replaced or truncated; copy the recording again",
                    )
                self.shard_paths.append(full)
                self.shards.append(Trace(full, display_path=shown))
            self._merge()
        except BaseException:
            self.close()
            raise

    # -- merging -------------------------------------------------------------------------
    def _merge(self) -> None:
        first = self.shards[0]
        semantics = first.meta.extra.get("weights_semantics")
        self._bias: dict[int, torch.Tensor] = {}
        self._parts: dict[int, list[_Part]] = {}
        ref_info: dict[int, tuple[int, LayerInfo]] = {}
        offsets: dict[int, list[int]] = {}
        has_padding: dict[int, bool] = {}
        has_bias: dict[int, bool] = {}
        for s, shard in enumerate(self.shards):
            if shard.meta.router != first.meta.router:
                raise RouteToolError(
                    f"shard {s} has router parameters {shard.meta.router} but shard 0 has {first.meta.router}",
                    path=shard.display_path, tensor="__metadata__",
                    fix="a sharded trace needs one router configuration; replay the shards separately",
                )
            if shard.meta.extra.get("weights_semantics") != semantics:
                raise RouteToolError(
                    f"shard {s} has weights_semantics={shard.meta.extra.get('weights_semantics')!r} but shard 0 "
                    f"has {semantics!r}", path=shard.display_path, tensor="__metadata__",
                    fix="replay the shards separately",
                )
            for layer in shard.layers:
                info = shard.info(layer)
                if layer in ref_info:
                    s0, i0 = ref_info[layer]
                    for attr, what in (("gating_dtype", "gating_output dtype"),
                                       ("has_recorded_ids", "recorded topk_ids"),
                                       ("has_recorded_weights", "recorded topk_weights")):
                        if getattr(info, attr) != getattr(i0, attr):
                            raise RouteToolError(
                                f"shard {s} disagrees with shard {s0} on {what} "
                                f"({getattr(info, attr)} vs {getattr(i0, attr)})",
                                path=shard.display_path, tensor=f"layers.{layer}",
                                fix="every shard must be recorded the same way; replay the shards separately",
                            )
                    if not torch.equal(shard.bias(layer), self._bias[layer]):
                        diff = float((shard.bias(layer) - self._bias[layer]).abs().max())
                        raise RouteToolError(
                            f"shard {s} has another bias than shard {s0} (max |difference| {diff:.3g})",
                            path=shard.display_path, tensor=f"layers.{layer}.bias",
                            fix="the bias changed during the recording; replay the shards separately",
                        )
                else:
                    ref_info[layer] = (s, info)
                    self._bias[layer] = shard.bias(layer)
                    offsets[layer] = [0]
                    self._parts[layer] = []
                has_padding[layer] = has_padding.get(layer, False) or info.has_padding
                has_bias[layer] = has_bias.get(layer, False) or info.has_bias
                base = offsets[layer][-1]
                self._parts[layer].append(_Part(shard=s, row_offset=base, step_offset=len(offsets[layer]) - 1,
                                                num_tokens=info.num_tokens))
                offsets[layer].extend(base + o for o in info.step_offsets[1:])
        self._infos: dict[int, LayerInfo] = {}
        for layer, (_, info) in ref_info.items():
            offs = tuple(offsets[layer])
            self._infos[layer] = replace(info, num_tokens=offs[-1], step_offsets=offs if len(offs) > 1 else (0,),
                                         has_padding=has_padding[layer], has_bias=has_bias[layer])
        self.layers = tuple(sorted(self._infos))
        extra = {k: v for k, v in first.meta.extra.items() if k not in _PER_SHARD_META}
        extra["shards"] = str(len(self.shards))
        self.meta = TraceMeta(model=first.meta.model, router=first.meta.router,
                              provenance=first.meta.provenance, extra=extra)

    # -- context manager -------------------------------------------------------------------
    def __enter__(self) -> ShardedTrace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for shard in self.shards:
            shard.close()

    # -- data access (the Trace interface) ---------------------------------------------------
    def info(self, layer: int) -> LayerInfo:
        """Header facts of ``layer`` over all shards. Raises KeyError for a missing layer."""
        return self._infos[layer]

    def bias(self, layer: int) -> torch.Tensor:
        """``[E]`` float32 bias of ``layer`` (equal in every shard)."""
        return self._bias[layer]

    def _fill_padding(self, step: Step, layer: int) -> Step:
        if self._infos[layer].has_padding and step.is_padding is None:
            step.is_padding = torch.zeros(step.num_tokens, dtype=torch.bool)
        return step

    def read_rows(self, layer: int, start: int, stop: int) -> Step:
        """Rows ``[start, stop)`` of ``layer`` (global row numbers) as a :class:`Step`
        (index -1), read from the shards that hold them."""
        info = self._infos[layer]
        start, stop = max(0, start), min(stop, info.num_tokens)
        pieces: list[Step] = []
        for part in self._parts[layer]:
            lo, hi = max(start, part.row_offset), min(stop, part.row_offset + part.num_tokens)
            if lo >= hi:
                continue
            piece = self.shards[part.shard].read_rows(layer, lo - part.row_offset, hi - part.row_offset)
            pieces.append(self._fill_padding(piece, layer))
        if not pieces:  # an empty range: empty tensors of the right shapes and dtypes
            first = self._parts[layer][0]
            pieces.append(self._fill_padding(self.shards[first.shard].read_rows(layer, 0, 0), layer))
        if len(pieces) == 1:
            out = pieces[0]
            out.start = start
            return out

        def cat(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in pieces]
            if not values or values[0] is None:
                return None
            return torch.cat(values)

        return Step(layer=layer, index=-1, start=start, gating_output=cat("gating_output"), bias=self._bias[layer],
                    is_padding=cat("is_padding"), recorded_ids=cat("recorded_ids"),
                    recorded_weights=cat("recorded_weights"))

    def steps(self, layer: int) -> Iterator[Step]:
        """Yield the steps of ``layer``, shard after shard, one at a time; ``index`` and
        ``start`` are numbered over the whole sharded trace."""
        for part in self._parts[layer]:
            for step in self.shards[part.shard].steps(layer):
                step.index += part.step_offset
                step.start += part.row_offset
                yield self._fill_padding(step, layer)

    @property
    def total_tokens(self) -> int:
        return sum(i.num_tokens for i in self._infos.values())
