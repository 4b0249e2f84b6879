"""Inputs, classified once, and outputs, checked once: the one module commands call for paths.

:func:`classify` tells what a path given as an input is, once, before anything opens it:

* ``trace``: one trace v1 ``.safetensors`` file (:class:`routetool.io.tracefile.Trace`);
* ``index``: a sharded trace's ``.json`` index (:class:`routetool.io.sharded.ShardedTrace`);
* ``run folder``: a folder of ``rank-<r>/`` traces (:class:`routetool.io.run.RunInput`);
* ``dump``: a routing dump of token rows that ``routetool import`` reads, by
  :func:`detect_format` (JSON lines, CSV, the engines' outputs: :mod:`routetool.io.engine_dumps`);
* ``counts``: a dump of per-expert counts (counts JSON, Megatron expert-load ``.npz``, SGLang
  stat or per-pass ``.pt``), which ``routetool balance`` reads and no trace can be made of.

A missing path, a FIFO or a folder that is none of these is classified by its name as a trace,
an index or a run folder, and the opener names what is wrong with it. :func:`open_trace` and
:func:`open_input` open what a trace-reading command takes, refusing a dump with the command
that reads it (:func:`refuse_dump`); ``routetool import`` and ``balance`` read dumps through
:mod:`routetool.io.dumps`, which sits above this module.

Outputs: :func:`check_output_paths` refuses, before any work, an output that cannot be written
or would destroy data (an input, an index's shard, a file of a run folder's rank); the paths
themselves are examined by :mod:`routetool.io.paths`, which also writes outputs safely.

Importing this module imports no torch (the commands check their paths before torch is
loaded); the readers below it that do (:mod:`~routetool.io.tracefile`,
:mod:`~routetool.io.sharded`, :mod:`~routetool.io.engine_dumps`) are imported where a path
is classified or opened.
"""

from __future__ import annotations

import os
import re
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from routetool.errors import RouteToolError
from routetool.io.dump_options import FORMATS
from routetool.io.jsonstrict import JSONProblem, loads
from routetool.io.paths import (  # noqa: F401 - require_input and the claims: part of this interface
    check_output_folder, claim_outputs, forget_claims, natural_key, path_kind, refuse_special_file, require_input,
    resolved, same_file,
)
from routetool.io.run import RunInput, folder_error, is_run_folder, rank_folders
from routetool.numtext import parse_int

# ---------------------------------------------------------------------------------------
# what a path is
_DUMP_SUFFIXES = (".jsonl", ".ndjson", ".csv", ".tsv", ".pt", ".pth", ".json", ".npy", ".npz", ".safetensors")
"""The files of a dump folder that the readers read."""


def _refuse_special_files(path: Path) -> None:
    """A dump, or a file a dump folder holds for the readers, that is a FIFO, device or socket
    is refused before anything opens it (reading one could block forever) or names it by its
    extension alone (``x.safetensors`` as a trace)."""
    fix = "write it to a regular file and pass that"
    refuse_special_file(path, fix=fix)
    if path_kind(path) == "folder":
        try:
            entries = [p for p in path.iterdir() if p.suffix.lower() in _DUMP_SUFFIXES]
        except OSError:
            return  # the folder's reader names why it cannot be listed
        for p in entries:
            refuse_special_file(p, fix=fix)


def _is_trace_index(path: Path) -> bool:
    """A sharded-trace index: JSON whose top-level ``format`` is ``routetool-trace-index``."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(65536)
    except OSError:
        return False
    return re.search(rb'"format"\s*:\s*"routetool-trace-index"', head) is not None


DUMP_SUFFIXES = (".csv", ".jsonl", ".ndjson", ".json", ".pt", ".pth", ".npy", ".npz", ".safetensors")
"""The file names a folder of routing dumps is read by (:func:`detect_format`)."""


def detect_format(path: Path) -> str:
    """The reader for ``path`` (file or folder) by extension, then by content.

    Raises:
        RouteToolError: missing path, a FIFO, device or socket (also as a dump file of a
            folder), or nothing recognisable.
    """
    from routetool.io.engine_dumps import sniff

    require_input(path, what="file or folder")
    _refuse_special_files(path)
    if path_kind(path) == "folder":
        if is_run_folder(path):
            return "trace"  # a run folder of rank-<r>/ traces (routetool.io.run)
        try:
            kinds = {p.suffix.lower() for p in path.iterdir() if not p.name.startswith(".") and path_kind(p) == "file"}
        except OSError as exc:
            raise RouteToolError(f"cannot list the folder ({exc.strerror or exc})", path=path,
                                 fix="check permissions") from None
        dump_kinds = {".csv", ".pt", ".pth", ".jsonl", ".ndjson", ".npy", ".npz"}

        def first(suffixes: tuple[str, ...]) -> Path:  # the folder's first file of a kind, in natural order
            return min((p for p in path.iterdir() if p.suffix.lower() in suffixes and not p.name.startswith(".")),
                       key=natural_key)

        for suffixes, fmt in (((".csv",), "csv"), ((".pt", ".pth"), "sglang"), ((".jsonl", ".ndjson"), "jsonl"),
                              ((".npy",), "vllm"), ((".npz",), "megatron-ep-load")):
            if kinds & set(suffixes):
                if len(kinds & dump_kinds) > 1:
                    raise RouteToolError("the folder mixes dump formats", path=path,
                                         fix="put one kind of file (CSV, .pt, JSONL, .npy or .npz) in a folder")
                if fmt in ("sglang", "jsonl"):  # the engines' .pt and JSON lines: by the first file's content
                    fmt = sniff(first(suffixes)) or fmt
                return fmt
        if ".safetensors" in kinds:  # FlashInfer-Trace workload blobs, or traces
            if sniff(first((".safetensors",))) == "flashinfer-trace":
                return "flashinfer-trace"
        if ".json" in kinds:  # the engines' JSON responses (vLLM, SGLang), by the first file's content
            if (engine := sniff(first((".json",)))) is not None:
                return engine
        if kinds & {".json", ".safetensors"}:  # a trace (or a rank's) in a folder: name it
            raise folder_error(path)
        raise RouteToolError(f"the folder holds no routing dump: no {', '.join(DUMP_SUFFIXES)} file", path=path,
                             fix="point at a routing dump or a folder of them; folders inside it are not read")
    suffix = path.suffix.lower()
    engine = sniff(path)  # the engines' own outputs (.npy, .npz, FlashInfer-Trace .safetensors, ...)
    if engine is not None:
        return engine
    if suffix == ".safetensors":
        return "trace"
    if suffix == ".json" and _is_trace_index(path):
        return "trace"  # a sharded trace's index (routetool.io.sharded)
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
            loads(first_line.decode("utf-8"))
            return "jsonl" if b"\n" in text.strip() else "counts-json"
        except (JSONProblem, UnicodeDecodeError):  # the reader says where
            return "counts-json"
    if len(head) >= 8 and head[:8] != b"\x00" * 8 and b"__metadata__" in head[:4096]:
        return "trace"
    if head[:2] == b"PK":
        return "sglang"
    raise RouteToolError("cannot tell the format from the name or content", path=path,
                         fix=f"pass --format {'|'.join(f for f in FORMATS if f not in ('auto', 'trace'))}")


_DUMP_KINDS = {  # format: (a file, a folder)
    "jsonl": ("a JSON-lines routing dump", "a folder of JSON-lines routing dumps"),
    "csv": ("a CSV routing dump", "a folder of CSV routing dumps"),
    "sglang": ("an SGLang routing dump (.pt)", "a folder of SGLang routing dumps (.pt)"),
    "vllm": ("vLLM routed experts", "a folder of vLLM routed experts (.npy)"),
    "sglang-routed": ("SGLang routed experts (/generate responses)", "a folder of SGLang /generate responses"),
    "megatron": ("a Megatron RouterReplay recording (.pt)", "a folder of Megatron RouterReplay recordings (.pt)"),
    "flashinfer-trace": ("a FlashInfer-Trace MoE workload (.safetensors)",
                         "a folder of FlashInfer-Trace MoE workloads (.safetensors)"),
}
"""The dumps of token rows a trace command recognises and names (:func:`refuse_dump_as_trace`)."""

_COUNTS_KINDS = {  # format: (a file, a folder)
    "counts-json": ("a JSON file of per-expert counts", "a folder of per-expert counts"),
    "megatron-ep-load": ("a Megatron expert-load dump of per-expert counts (.npz)",
                         "a folder of Megatron expert-load dumps of per-expert counts (.npz)"),
    "sglang": ("an SGLang expert-distribution dump of per-expert counts (stat or per-pass .pt)",
               "a folder of SGLang expert-distribution dumps of per-expert counts (.pt)"),
}
"""The dumps of per-expert counts a trace command recognises and names: balance reads them,
import cannot make a trace of them (:func:`refuse_dump_as_trace`)."""

_IMPORT_NEEDS = {"sglang-routed": " --topk K"}
"""The options ``routetool import`` needs for a format whose file does not record them."""


def _holds_counts(path: Path, fmt: str | None) -> bool:
    """Whether the dump ``path`` (a file, or a folder's first file) that :func:`detect_format`
    read as ``fmt`` holds per-expert counts rather than token rows: a counts JSON (a JSON
    object without the ``format`` key every routetool trace index has), a Megatron expert-load
    ``.npz``, an SGLang stat (``logical_count``) or per-pass (``global_physical_count`` without
    ``topk_ids_of_layer``) ``.pt``."""
    if fmt == "megatron-ep-load":
        return True
    if fmt not in ("counts-json", "sglang"):
        return False
    if path_kind(path) == "folder":
        suffixes = (".json",) if fmt == "counts-json" else (".pt", ".pth")
        files = [p for p in path.iterdir() if p.suffix.lower() in suffixes and not p.name.startswith(".")]
        if not files:
            return False
        path = min(files, key=natural_key)
    if fmt == "counts-json":
        try:
            if path.stat().st_size > MAX_COUNTS_JSON_BYTES:
                return False
            doc = loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, JSONProblem):
            return False
        return isinstance(doc, dict) and "format" not in doc and _counts_tables(doc)
    from routetool.io.engine_dumps import _torch_pickle_head

    head = _torch_pickle_head(path)
    # (per_token records hold their topk_ids_of_layer beside the counts every record has)
    return b"logical_count" in head or (b"global_physical_count" in head and b"topk_ids_of_layer" not in head)


MAX_COUNTS_JSON_BYTES = 64 << 20
"""A JSON file larger than this is not parsed to tell whether it holds counts (the trace-index
reader, which reads only small files, names it)."""


def _counts_tables(doc) -> bool:
    """Whether a parsed JSON value nests objects down to tables of counts: ``{"<expert>":
    <count>}`` (keys decimal numbers) or ``[<count>, ...]``, counts whole numbers >= 0, at every
    leaf (a report or a config holds text somewhere)."""
    if isinstance(doc, list):
        return bool(doc) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in doc)
    if not isinstance(doc, dict) or not doc:
        return False
    if all(isinstance(v, int) and not isinstance(v, bool) for v in doc.values()):
        return all(parse_int(k) is not None for k in doc) and all(v >= 0 for v in doc.values())
    return all(_counts_tables(v) for v in doc.values())


def _detected(path: Path) -> str | None:
    try:
        return detect_format(path)
    except RouteToolError:
        return None


INPUT_KINDS = ("trace", "index", "run folder", "dump", "counts")
"""What :func:`classify` finds a path given as an input to be."""


@dataclass(frozen=True)
class InputPath:
    """A path given as an input, classified once (:func:`classify`).

    Attributes:
        kind: one of :data:`INPUT_KINDS`.
        path: the path as opened. display_path: as messages name it (the path, or what the
            user typed for it); None: ``path``.
        found: what :func:`routetool.io.paths.path_kind` finds there (``file``, ``folder``,
            ``missing``, ...).
        format: :func:`detect_format`'s answer for a dump (``jsonl``, ``csv``, ``vllm``, ...);
            None when it is no dump, or when detection refused it (the opener names why).
    """

    kind: str
    path: Path
    display_path: Path | None
    found: str
    format: str | None = None

    @property
    def shown(self) -> Path:
        """The path as messages name it."""
        return self.path if self.display_path is None else self.display_path


def classify(path: str | os.PathLike, *, display_path: str | os.PathLike | None = None) -> InputPath:
    """What the input ``path`` is (see the module docstring), read from its kind, name and first
    bytes only.

    Raises:
        RouteToolError: the path cannot be examined (a loop of links, a NUL byte), naming
            ``display_path`` (default ``path``).
    """
    from routetool.io.sharded import looks_like_index

    p = Path(path)
    found = path_kind(p, shown=display_path)
    fmt = _detected(p) if found in ("file", "folder") else None
    if _holds_counts(p, fmt):
        kind = "counts"
    elif fmt in _DUMP_KINDS:
        kind = "dump"
    elif found == "folder":
        kind = "run folder"  # (one without rank-<r>/ folders is named by the run reader)
    elif found == "file" and looks_like_index(p) or (found in ("missing", "dangling link") and p.suffix.lower() == ".json"):
        kind = "index"
    else:
        kind = "trace"
    return InputPath(kind=kind, path=p, display_path=None if display_path is None else Path(display_path), found=found,
                     format=fmt if kind in ("dump", "counts") else None)


def refuse_dump(inp: InputPath) -> None:
    """Refuse, for a command that reads traces, an input :func:`classify` found to be a routing
    dump, naming what it is and the command that reads it: a dump of token rows (JSON lines,
    CSV, the engines' outputs, or a folder of them) -> ``routetool import PATH -o
    trace.safetensors`` (with the options the format needs) or ``routetool balance PATH``; a
    dump of per-expert counts -> ``routetool balance PATH``. A trace reader would only say that
    it is no safetensors file or no JSON trace index.

    A ``.json`` file with a ``format`` key is left to the trace-index reader, which says what
    is wrong with it. Anything :func:`detect_format` refuses (a missing path, a FIFO) is left
    to the trace reader, which names it.

    Raises:
        RouteToolError: naming the input as shown, what it looks like, and the command that
            reads it.
    """
    if inp.kind not in ("dump", "counts"):
        return
    quoted = shlex.quote(str(inp.shown))
    if inp.kind == "counts":
        kind = _COUNTS_KINDS[inp.format][inp.found == "folder"]
        raise RouteToolError(f"looks like {kind}, not a routetool trace", path=inp.shown,
                             fix=f"analyse its load with `routetool balance {quoted}`; counts have no per-token "
                                 "expert ids, so no trace can be made of them")
    kind = _DUMP_KINDS[inp.format][inp.found == "folder"]
    needs = _IMPORT_NEEDS.get(inp.format, "")
    raise RouteToolError(f"looks like {kind}, not a routetool trace", path=inp.shown,
                         fix=f"convert it with `routetool import {quoted} -o trace.safetensors{needs}`"
                             + (" (K: the model's experts per token)" if needs else "")
                             + f", or analyse its load with `routetool balance {quoted}{needs}`")


def refuse_dump_as_trace(path: str | os.PathLike, display_path: object = None) -> None:
    """:func:`refuse_dump` of :func:`classify`'s answer for ``path``.

    Raises:
        RouteToolError: as :func:`refuse_dump` and :func:`classify` do.
    """
    refuse_dump(classify(path, display_path=display_path))


# ---------------------------------------------------------------------------------------
# opening what trace commands read
def _open_classified(inp: InputPath):
    """The trace ``inp`` names (an index or a file; anything else is named by the file reader)."""
    from routetool.io.sharded import ShardedTrace
    from routetool.io.tracefile import Trace

    refuse_dump(inp)
    if inp.kind == "index":
        return ShardedTrace(inp.path, display_path=inp.display_path)
    return Trace(inp.path, display_path=inp.display_path)


def open_trace(path: str | os.PathLike, *, display_path: str | os.PathLike | None = None):
    """Open any routetool trace: one ``.safetensors`` file, or a sharded trace's index.

    The one entry point every command uses to read a trace. A path ending in ``.json``, or a
    file whose content is JSON text, is read as a sharded-trace index
    (:class:`routetool.io.sharded.ShardedTrace`, see that module for the index format);
    anything else as a single trace v1 file (:class:`routetool.io.tracefile.Trace`). Both have
    the same public interface: ``path``, ``display_path``, ``meta``, ``layers``, ``info(L)``,
    ``bias(L)``, ``steps(L)``, ``read_rows(L, start, stop)``, ``total_tokens``, ``close()``,
    context manager.

    A routing dump that ``routetool import`` reads (JSON lines, CSV, SGLang ``.pt``) is refused
    as such, naming ``routetool import`` and ``routetool balance`` (:func:`refuse_dump`).

    Raises:
        RouteToolError: as :class:`~routetool.io.tracefile.Trace` or
            :class:`~routetool.io.sharded.ShardedTrace` do; a routing dump.
    """
    return _open_classified(classify(path, display_path=display_path))


def open_input(path: str | os.PathLike, *, display_path: str | os.PathLike | None = None) -> RunInput:
    """Open a trace file, a sharded trace's index or a run folder as a
    :class:`~routetool.io.run.RunInput` (a trace: a run of one rank).

    Raises:
        RouteToolError: a routing dump, or a folder of them (:func:`refuse_dump`); as
            :class:`~routetool.io.run.RunInput` and :func:`open_trace` do.
    """
    return open_classified(classify(path, display_path=display_path))


def open_classified(inp: InputPath) -> RunInput:
    """:func:`open_input` of a path :func:`classify` has classified already (a command that
    reads dumps too classifies its inputs once and opens the traces among them with this).

    Raises:
        RouteToolError: as :func:`open_input` does.
    """
    if inp.found != "folder":
        trace = _open_classified(inp)
        try:
            return RunInput.of_trace(trace)
        except BaseException:
            trace.close()
            raise
    refuse_dump(inp)  # a folder of CSV dumps, named as such
    return RunInput(inp.path, display_path=inp.display_path, open_trace=open_trace)


# ---------------------------------------------------------------------------------------
# outputs
def refuse_rank_folder(folder: str | os.PathLike, ranks: list[Path], *, shown: object = None) -> None:
    """Refuse an output that would go into one of ``ranks``, the rank folders of a run folder read
    in this run (:func:`routetool.io.run.rank_folders`), whether its file exists or not: a rank
    folder holds its rank's trace and nothing else, and a new ``.json`` or ``.safetensors`` file
    there would be read as part of it.

    Raises:
        RouteToolError: naming ``shown`` (default ``folder``).
    """
    for r in ranks:
        if same_file(folder, r):
            raise RouteToolError("is in a rank folder of this run's input, which holds that rank's trace and nothing "
                                 "else (a file written there would be read as part of it)",
                                 path=folder if shown is None else shown,
                                 fix="write outputs outside the run folder's rank-<r>/ folders")


def _json_files(folder: Path) -> list[Path]:
    """The ``.json`` files directly in ``folder`` (indexes whose shards an output must not replace)."""
    try:
        return [Path(e.path) for e in os.scandir(folder) if e.name.lower().endswith(".json") and e.is_file()]
    except OSError:
        return []


def check_output_paths(outputs, *, force: bool, inputs=(), allow_stdout: bool = True, folders=()) -> None:
    """Fail before any work when an output cannot be written or would destroy data.

    Args:
        outputs: output paths (None entries are ignored; ``-`` means stdout when allowed).
        force: allow replacing existing files (never an input, never twice in one run).
        inputs: the run's input paths (a sharded trace's index stands for its shard files
            too, a folder for the files directly in it and a run folder for its ranks' traces);
            no output may be one of them.
        allow_stdout: whether ``-`` is accepted.
        folders: output folders (``--plot DIR``, a run folder's ``--save-routing``; None entries
            ignored), whose own rules their sinks check: here only that none is named twice or
            for a file output too, and none is an input folder or inside one.

    Raises:
        RouteToolError: ``-`` where a file is needed; two outputs naming the same file or folder;
            an output folder that is an input folder or inside one; an
            output that is an input or an existing file of an input folder; an existing file
            (or link) without ``force``; a directory; a FIFO, device or socket; a missing or
            unwritable folder (probed by creating a temporary file), or a file where a folder
            belongs (:func:`check_output_folder`); an output or input path that cannot be
            examined (a loop of symbolic links, a NUL byte: :func:`path_kind`).
    """
    from routetool.io.sharded import listed_shard_files

    protected = [Path(i) for i in inputs if i is not None and str(i) != "-"]
    ranks = [folder for i in protected for folder in rank_folders(i)]
    protected += ranks  # a run folder's ranks
    protected += [index for i in list(protected) if path_kind(i) == "folder" for index in _json_files(i)]
    protected += [shard for i in list(protected) for shard in listed_shard_files(i)]
    seen: list[Path] = []
    for out in outputs:
        if out is None:
            continue
        if str(out) == "-":
            if not allow_stdout:
                raise RouteToolError("'-' (stdout) cannot take this output", path="-", fix="name a file")
            continue
        p = Path(out)
        kind = path_kind(p)
        for other in seen:
            if same_file(p, other):
                raise RouteToolError("is named for two outputs of one run", path=p, fix="give each output its own file")
        seen.append(p)
        if kind == "folder":
            raise RouteToolError("is a directory", path=p, fix="name a file")
        refuse_rank_folder(p.parent, ranks, shown=p)
        for inp in protected:
            if path_kind(inp) == "folder" and kind != "missing" and same_file(p.parent, inp):
                raise RouteToolError("is a file in this run's input folder; writing the output there would replace "
                                     "it", path=p, fix="choose another output path")
            if same_file(p, inp):
                raise RouteToolError("is this run's input; writing the output there would destroy it", path=p,
                                     fix="choose another output path")
        if kind == "special":  # a FIFO, device or socket (or a link to one): never replaced
            raise RouteToolError("is not a regular file (a FIFO, device or socket)", path=p,
                                 fix="name a regular file, or - for stdout")
        if kind != "missing" and not force:  # (a dangling link too)
            raise RouteToolError("already exists", path=p, fix="choose another path or pass --force to replace it")
        folder = p.parent if str(p.parent) else Path(".")
        check_output_folder(folder)
        try:
            fd, probe = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".probe", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise RouteToolError(f"folder is not writable ({exc.strerror or exc})", path=folder,
                                 fix="choose a writable folder") from None
    for out in folders:
        if out is None:
            continue
        p = Path(out)
        for other in seen:
            if same_file(p, other):
                raise RouteToolError("is named for two outputs of one run", path=p, fix="give each output its own path")
        seen.append(p)
        where = resolved(p)
        for inp in protected:
            if path_kind(inp) == "folder" and (where == resolved(inp) or resolved(inp) in where.parents):
                raise RouteToolError(f"is inside this run's input folder {inp}; writing there would change the input",
                                     path=p, fix="write it outside the input")
    claim_outputs(outputs, force=force)
