"""Inputs of several ranks: a run folder (one trace per process of a parallel run) read as one input.

A capture from a multi-process engine (the vLLM plugin, or ``RoutingRecorder`` with ``{rank}``
in its output path) is a *run folder* (docs/trace-format.md, "Run folders")::

    RUN/rank-0/trace.json   (+ its shards)     one trace per rank: a sharded trace's index,
    RUN/rank-1/trace.json                      or one .safetensors file
    ...

:func:`routetool.io.inputs.open_input` opens what every trace-reading command takes, a trace
file, an index or a run folder, as a :class:`RunInput` of one or more :class:`RankTrace`; a
plain trace is a run of one rank whose ``rank`` is None. Each rank's trace is read as a trace
by itself (the ``open_trace`` it is given: :func:`routetool.io.inputs.open_trace`, which this
module does not import, so that it stays below the readers of dumps); the ranks must agree on the router (every field of
:class:`routetool_kernels.spec.RouterSpec`) and on ``weights_semantics``.

Which ranks routed the same tokens (:meth:`RunInput.token_groups`): the ranks of one
data-parallel rank (its tensor-parallel peers, same ``dp_rank`` in the metadata) route the
same tokens, so a global expert load counts one of them (the lowest rank); ranks of different
DP ranks route different tokens and add. A rank whose ``dp_rank`` is unknown (a plain torchrun
job records none) counts as a data-parallel rank of its own: its load adds.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from routetool.errors import RouteToolError
from routetool.io.paths import path_kind

RANK_FOLDER = re.compile(r"rank-(0|[1-9][0-9]{0,5})")
"""A rank folder's name: ``rank-<r>``, ``r`` in plain decimal digits."""

LAYOUT_FIELDS = ("rank", "world_size", "local_rank", "dp_rank", "dp_size", "tp_rank", "tp_size",
                 "ep_rank", "ep_size", "pp_rank", "pp_size")
"""The parallel-layout metadata a recorder writes (:class:`routetool.capture.ranks.RankInfo`)."""

_KNOWN_FOR_IDS_ONLY = ("num_experts", "topk")  # what an ids-only import records of its router


@dataclass
class RankTrace:
    """One rank's trace of a run.

    Attributes:
        rank: the global rank (from the folder's name), or None for a plain trace.
        trace: the open trace (:class:`~routetool.io.trace.Trace` or a sharded trace).
        layout: the known layout fields (:data:`LAYOUT_FIELDS`) from the trace's metadata.
    """

    rank: int | None
    trace: object
    layout: dict[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``rank-<r>`` (empty for a plain trace)."""
        return "" if self.rank is None else f"rank-{self.rank}"

    @property
    def role(self) -> str:
        """The rank's place in words, e.g. ``dp 1 tp 0``; empty when nothing is known."""
        parts = [f"{name} {self.layout[f'{name}_rank']}" for name in ("dp", "tp", "ep", "pp")
                 if f"{name}_rank" in self.layout]
        return " ".join(parts)


def _layout(meta_extra, shown: object = None) -> dict[str, int]:
    """The layout fields of a trace's metadata (decimal strings).

    Raises:
        RouteToolError: a field present but not a plain non-negative integer.
    """
    out = {}
    for name in LAYOUT_FIELDS:
        value = meta_extra.get(name)
        if value is None:
            continue
        if not (isinstance(value, str) and value.isascii() and value.isdigit()):
            raise RouteToolError(f"the metadata {name}={value!r} is not a plain non-negative integer", path=shown,
                                 fix="write the rank's layout as decimal digits, or leave the field out")
        out[name] = int(value)
    return out


def trace_layout(trace) -> dict[str, int]:
    """A trace's layout fields, the same in all that holds them: every shard's metadata and a
    sharded trace's index (its ``"ranks"`` object).

    Raises:
        RouteToolError: a bad field, or two of them that disagree (naming the shard or the index).
    """
    sources = [(shard.display_path, shard.meta.extra) for shard in getattr(trace, "shards", [trace])]
    ranks = getattr(trace, "index", {}).get("ranks") if isinstance(getattr(trace, "index", None), dict) else None
    if isinstance(ranks, dict):
        sources.append((trace.display_path, {k: str(v) if isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                             else v for k, v in ranks.items() if k in LAYOUT_FIELDS and v is not None}))
    out: dict[str, int] = {}
    first: dict[str, object] = {}
    for shown, extra in sources:
        for name, value in _layout(extra, shown).items():
            if name in out and out[name] != value:
                raise RouteToolError(f"says {name} {value}, {first[name]} says {out[name]}: one trace is one rank's",
                                     path=shown, fix="keep each rank's recording in its own rank folder")
            out.setdefault(name, value)
            first.setdefault(name, shown)
    if "rank" in out and "world_size" in out and out["rank"] >= out["world_size"]:
        raise RouteToolError(f"says rank {out['rank']} of a world_size of {out['world_size']}: no such rank",
                             path=trace.display_path, fix="check the recording's rank metadata")
    return out


def trace_files(trace) -> list[Path]:
    """The files a trace reads: its shards, or the file itself."""
    return list(getattr(trace, "shard_paths", None) or [trace.path])


def refuse_shared_files(traces: list[tuple[str, object]]) -> None:
    """Refuse two traces that read one file (``(label, trace)`` pairs): its steps would be counted
    twice (a rank folder linked to another, an index listing another rank's shard, one trace
    given twice through its run folder).

    Raises:
        RouteToolError: naming the file and both traces.
    """
    seen: dict[tuple[int, int], str] = {}
    for label, trace in traces:
        for f in trace_files(trace):
            try:
                st = os.stat(f)
            except OSError:
                continue  # (reading it says what is wrong)
            key = (st.st_dev, st.st_ino)
            if key in seen and seen[key] != label:
                raise RouteToolError(f"is read by {label} and by {seen[key]}: its steps would be counted twice",
                                     path=f, fix="give each rank, and each trace, its own files")
            seen.setdefault(key, label)


def is_run_folder(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder holding at least one ``rank-<r>`` folder."""
    p = Path(path)
    if path_kind(p) != "folder":
        return False
    try:
        return any(RANK_FOLDER.fullmatch(e.name) and e.is_dir() for e in os.scandir(p))
    except OSError:
        return False


def rank_folders(path: str | os.PathLike) -> list[Path]:
    """The ``rank-<r>`` folders of a run folder (none for anything else), for protecting inputs."""
    if not is_run_folder(path):
        return []
    try:
        return [Path(e.path) for e in os.scandir(path) if RANK_FOLDER.fullmatch(e.name) and e.is_dir()]
    except OSError:
        return []


def folder_error(path: str | os.PathLike, shown: object = None) -> RouteToolError:
    """The error for a folder given where a trace is read that is no run folder, naming what to
    give instead: the trace it holds (and, for a rank folder, its run folder), or the three inputs."""
    p = Path(path)
    shown = Path(shown) if shown is not None else p
    try:
        traces = sorted(e.name for e in os.scandir(p) if e.is_file() and e.name.lower().endswith((".json", ".safetensors")))
    except OSError:
        traces = []
    indexes = [n for n in traces if n.lower().endswith(".json")]
    named = indexes[:1] if len(indexes) == 1 else traces if len(traces) == 1 else []
    if named:
        fix = f"name the trace itself, {shown / named[0]}"
        if RANK_FOLDER.fullmatch(p.name) and is_run_folder(p.parent):
            fix += f", or the run folder {shown.parent} for every rank"
        return RouteToolError("is a folder holding a trace, not a trace and not a run folder (no rank-<r>/ folders)",
                              path=shown, fix=fix)
    return RouteToolError("is a folder without rank-<r>/ traces: not a trace, not a run folder", path=shown,
                          fix="name a .safetensors trace, a sharded trace's .json index, or a run folder of rank-<r>/ "
                              "traces")


def _rank_trace_path(folder: Path, shown: Path) -> Path:
    """The one trace of a rank folder: its ``*.json`` index, else its one ``.safetensors`` file."""
    try:
        names = sorted(e.name for e in os.scandir(folder) if e.is_file())
    except OSError as exc:
        raise RouteToolError(f"cannot list the rank folder ({exc.strerror or exc})", path=shown,
                             fix="check its permissions") from None
    indexes = [n for n in names if n.lower().endswith(".json")]
    files = [n for n in names if n.lower().endswith(".safetensors")]
    if len(indexes) == 1:
        return folder / indexes[0]
    if len(indexes) > 1:
        raise RouteToolError(f"holds {len(indexes)} indexes ({', '.join(indexes[:3])}), one rank's trace needs one",
                             path=shown, fix="keep one trace per rank folder")
    if len(files) == 1:
        return folder / files[0]
    if files:
        raise RouteToolError(f"holds {len(files)} .safetensors files and no index: which is the rank's trace is "
                             "unclear", path=shown, fix="keep one trace per rank folder, or its index with its shards")
    raise RouteToolError("holds no trace (no .json index, no .safetensors file)", path=shown,
                         fix="copy the rank's recording into it, or remove the empty rank folder")


class RunInput:
    """An input of one or more ranks: a run folder, or one trace (a run of one rank).

    Attributes:
        path / display_path: the input as given.
        is_run: whether it is a run folder.
        ranks: the ranks' traces, by rank.
        meta: the first rank's :class:`~routetool.io.trace.TraceMeta` (the router all ranks share).
        layers: every layer any rank holds, ascending.
        notes: facts worth reporting (ranks missing from the recorded world size).

    Use as a context manager; :meth:`close` closes every rank's trace. Opened by
    :func:`routetool.io.inputs.open_input`, which refuses a folder of routing dumps first and
    gives ``open_trace`` (how each rank's trace, or the one trace, is opened).

    Raises:
        RouteToolError: on open: a folder without ``rank-<r>`` folders, a rank folder without
            exactly one trace, a trace that names another rank than its folder, ranks that
            disagree on the router, or any error of reading a rank's trace.
    """

    def __init__(self, path: str | os.PathLike, *, open_trace, display_path: str | os.PathLike | None = None):
        self.path = Path(path)
        self.display_path = Path(display_path) if display_path is not None else self.path
        self.ranks: list[RankTrace] = []
        self.notes: list[str] = []
        self.is_run = path_kind(self.path, shown=self.display_path) == "folder"
        try:
            if not self.is_run:
                t = open_trace(self.path, display_path=self.display_path)
                self.ranks.append(RankTrace(rank=None, trace=t, layout=trace_layout(t)))
            else:
                self._open_ranks(open_trace)
            self._check_agree()
        except BaseException:
            self.close()
            raise
        self.meta = self.ranks[0].trace.meta
        self.layers = sorted({layer for r in self.ranks for layer in r.trace.layers})

    @classmethod
    def of_trace(cls, trace) -> RunInput:
        """An open trace as a run of one rank (closing it stays with the caller)."""
        self = cls.__new__(cls)
        self.path, self.display_path, self.is_run, self.notes = trace.path, trace.display_path, False, []
        self.ranks = [RankTrace(rank=None, trace=trace, layout=trace_layout(trace))]
        self.meta, self.layers = trace.meta, list(trace.layers)
        return self

    def _open_ranks(self, open_trace) -> None:
        try:
            names = [(m, e.name) for e in os.scandir(self.path) if (m := RANK_FOLDER.fullmatch(e.name))]
        except OSError as exc:
            raise RouteToolError(f"cannot list the folder ({exc.strerror or exc})", path=self.display_path,
                                 fix="check its permissions") from None
        # (path_kind: a rank folder that is a loop of links is named as such, not as the run folder)
        found = sorted((int(m.group(1)), name) for m, name in names
                       if path_kind(self.path / name, shown=self.display_path / name) == "folder")
        if not found:
            raise folder_error(self.path, self.display_path)
        for rank, name in found:
            shown_folder = self.display_path / name
            p = _rank_trace_path(self.path / name, shown_folder)
            t = open_trace(p, display_path=shown_folder / p.name)
            self.ranks.append(RankTrace(rank=rank, trace=t))
            layout = self.ranks[-1].layout = trace_layout(t)
            if layout.get("rank", rank) != rank:
                raise RouteToolError(f"holds the trace of rank {layout['rank']}, not of rank {rank}",
                                     path=shown_folder, fix=f"move it to rank-{layout['rank']}/")
        refuse_shared_files([(r.label, r.trace) for r in self.ranks])
        worlds = {r.layout["world_size"] for r in self.ranks if "world_size" in r.layout}
        if len(worlds) > 1:
            raise RouteToolError(f"its ranks were recorded in runs of different sizes (world_size "
                                 f"{', '.join(map(str, sorted(worlds)))})", path=self.display_path,
                                 fix="keep the ranks of one run in one folder")
        if worlds:
            world = worlds.pop()
            beyond = [r for r in self.ranks if r.rank >= world]
            if beyond:
                raise RouteToolError(f"holds {beyond[0].label}, but its ranks were recorded in a run of {world} "
                                     f"(ranks 0 to {world - 1})", path=self.display_path,
                                     fix="keep the ranks of one run in one folder")
            missing = sorted(set(range(world)) - {r.rank for r in self.ranks})
            if missing:
                shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
                self.notes.append(f"the run had {world} ranks; {len(missing)} hold no trace here (rank {shown}): "
                                  "totals cover the ranks present")

    def _check_agree(self) -> None:
        first = self.ranks[0]
        for other in self.ranks[1:]:
            a, b = first.trace.meta.router, other.trace.meta.router
            unknown = any("router_parameters" in r.trace.meta.extra for r in (first, other))
            differ = [n for n in a.differences(b) if not unknown or n in _KNOWN_FOR_IDS_ONLY]
            if differ:
                name = differ[0]
                raise RouteToolError(f"{other.label} routes with {name} {getattr(b, name)!r}, {first.label} with "
                                     f"{getattr(a, name)!r}: the ranks of one run share one router",
                                     path=self.display_path, fix="keep the ranks of one run (one model) in one folder")
            sa = first.trace.meta.extra.get("weights_semantics", "renormalized")
            sb = other.trace.meta.extra.get("weights_semantics", "renormalized")
            if sa != sb:
                raise RouteToolError(f"{other.label} records {sb} weights, {first.label} {sa}",
                                     path=self.display_path, fix="keep the ranks of one run in one folder")

    def token_groups(self, layer: int | None = None) -> list[list[int]]:
        """Indices into :attr:`ranks` (of the ranks holding ``layer``, or all), grouped by the
        tokens they route: one group per data-parallel rank (see the module docstring), each
        sorted by rank, the groups by their first rank."""
        groups: dict[object, list[int]] = {}
        for i, r in enumerate(self.ranks):
            if layer is not None and layer not in r.trace.layers:
                continue
            key = ("dp", r.layout["dp_rank"]) if "dp_rank" in r.layout else ("rank", i)
            groups.setdefault(key, []).append(i)
        return sorted(groups.values(), key=lambda g: g[0])

    @property
    def partial(self) -> list[PartialTrace]:
        """The ranks' traces that hold less than a whole recording (:func:`trace_partial`), by rank;
        empty when every one is whole."""
        return [p for r in self.ranks if (p := trace_partial(r.trace, r.rank)) is not None]

    def num_tokens(self, layers) -> int:
        """Rows of ``layers`` over every rank that holds them."""
        return sum(r.trace.info(layer).num_tokens for r in self.ranks for layer in layers if layer in r.trace.layers)

    def close(self) -> None:
        for r in self.ranks:
            r.trace.close()

    def __enter__(self) -> RunInput:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class PartialTrace:
    """A trace that holds less than a whole recording: what every command that reads it says in
    its first lines and its JSON (docs/cli-contract.md, "Partial traces").

    Attributes:
        trace: the trace as shown (a rank's trace in a run folder). rank: its rank, or None.
        sharded: whether it is a sharded trace (an index and its shards).
        index_complete: the index's ``"complete"`` (False: the recording stopped on an error,
            was killed or is still running; None: the index does not say, or one file).
        stopped_by: the index's ``"stopped_by"`` (None: unknown).
        steps: layer -> captured steps present, for every layer.
    """

    trace: str
    rank: int | None
    sharded: bool
    index_complete: bool | None
    stopped_by: str | None
    steps: dict[int, int]

    @property
    def unfinished(self) -> bool:
        """Whether the recording did not finish: a sharded trace whose index is not ``"complete": true``."""
        return self.sharded and self.index_complete is not True

    @property
    def unequal_steps(self) -> bool:
        """Whether the layers hold different numbers of steps (a step cut short inside the model)."""
        return len(set(self.steps.values())) > 1

    def why(self) -> str:
        """What makes the trace partial, in words: the unfinished recording and/or the unequal steps."""
        parts = []
        if self.unfinished:
            flag = "false" if self.index_complete is False else "missing"
            parts.append(f'the recording did not finish (index "complete": {flag}; stopped by: '
                         f'{self.stopped_by or "unknown: killed, or still recording"})')
        if self.unequal_steps:
            parts.append("its layers hold unequal steps (a step cut short inside the model)")
        return "; ".join(parts)

    def to_json(self) -> dict:
        """``{"trace", "rank", "why", "index_complete", "stopped_by", "unequal_steps", "steps": {layer: n}}``."""
        return {"trace": self.trace, "rank": self.rank, "why": self.why(), "index_complete": self.index_complete,
                "stopped_by": self.stopped_by, "unequal_steps": self.unequal_steps,
                "steps": {str(k): v for k, v in sorted(self.steps.items())}}


def trace_partial(trace, rank: int | None = None) -> PartialTrace | None:
    """The :class:`PartialTrace` of an open trace, or None for a whole one: a sharded trace whose
    index is not ``"complete": true``, or any trace whose layers hold unequal steps. Reads the
    index and the headers only."""
    steps = {layer: trace.info(layer).num_steps for layer in trace.layers}
    index = getattr(trace, "index", None)  # (a sharded trace's index document)
    sharded = isinstance(index, dict)
    p = PartialTrace(trace=str(trace.display_path), rank=rank, sharded=sharded,
                     index_complete=index.get("complete") if sharded else None,
                     stopped_by=index.get("stopped_by") if sharded else None, steps=steps)
    return p if p.unfinished or p.unequal_steps else None
