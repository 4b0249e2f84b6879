"""Limits on what an input may make routetool allocate, checked on declared sizes first.

A few bytes of input can declare a great deal: ``num_experts=1000000000000`` in a trace's
metadata, one expert id of 1,048,575 in a three-line dump (every per-expert table then has a
million entries, for every step), a 2 KB SGLang ``.pt`` holding a view that repeats one value
twenty million times (``torch.tensor([1, 2]).expand(1, 20_000_000, 2)``) or one record
referenced fifty thousand times (``[rec] * 50000``). The readers check such declarations here,
before anything is allocated, against one budget: an input may make routetool allocate at most
a fixed floor plus a fixed multiple of its own size (:func:`budget`). Legitimate inputs stay far
inside it; the work on them stays proportional to their size, never to the largest id they
name.

* Expert counts: at most :data:`MAX_EXPERTS` routed experts (traces and dumps alike) and
  layer ids below :data:`MAX_LAYERS`.
* Per-expert tables (:func:`check_expert_tables`): every step of a layer has a histogram of
  one int64 count per expert, and every layer more per-expert work (statistics, EPLB,
  reports; counted as :data:`TABLES_PER_LAYER` tables): ``8 * E * (steps + TABLES_PER_LAYER * layers)`` bytes, within
  ``budget(input bytes, TABLE_BYTES_PER_INPUT_BYTE)``. A trace with logits always fits (its
  logits are ``[T, E]``); an ids-only trace or a dump with an implausible E does not.
* Torch ``.pt`` dumps (:func:`check_torch_archive`, :func:`check_materialised`): the sizes a
  zip archive declares for its records before it is loaded, and the tensors once loaded
  counted as materialised (``numel * element_size``, so a stride-0 or expanded view counts
  every element it shows) once per reference (a record listed 50,000 times counts 50,000
  times), within ``budget(file bytes, MATERIALISED_PER_STORED_BYTE, MATERIALISED_FLOOR_BYTES)``.

Every refusal is a one-line :class:`~routetool.errors.RouteToolError` naming the file, the
sizes and the budget.
"""

from __future__ import annotations

import os
import zipfile

# MAX_EXPERTS: the largest expert count accepted (a trace's or dump's metadata, ids), 1,048,576: as a router spec
from routetool_kernels.spec import MAX_EXPERTS as MAX_EXPERTS
from routetool.errors import RouteToolError
MAX_LAYERS = 1 << 16
"""Layer ids must lie in ``[0, MAX_LAYERS)``."""
BUDGET_FLOOR_BYTES = 128 << 20
"""What any input, however small, may make routetool allocate for its per-expert tables: enough
for one token of every released MoE model (Qwen3-Next, 512 experts in 48 layers, needs 48 MiB)."""
TABLE_BYTES_PER_INPUT_BYTE = 1024
"""Bytes of per-expert tables allowed per byte of input. A real ids-only trace needs at most
``2 * E / K`` (decode steps of one token: 8 bytes per expert per step against ``4 * K`` bytes of
ids), under 260 for every released MoE model."""
TABLES_PER_LAYER = 256
"""Per-expert tables counted for each layer on top of one per step: the whole-layer histograms,
statistics, EPLB replication and packing and the reports cost, per expert and layer, about as
much time as 256 steps' histograms."""
MATERIALISED_FLOOR_BYTES = 4 << 20
"""What a torch ``.pt`` dump, however small, may hold once its tensors are materialised."""
MATERIALISED_PER_STORED_BYTE = 4
"""Materialised bytes allowed per byte of a ``.pt`` file: a real dump stores every tensor it
holds (about 1), an amplifying one repeats a few stored bytes (a stride-0 view) or references."""
MAX_NESTING = 64
"""Deepest nesting of containers read from a ``.pt`` dump (as :data:`routetool.io.jsonstrict.MAX_DEPTH`)."""


CHUNK_BYTES = 64 * 2**20
"""Bytes of data a command holds per chunk of a trace it streams (``[rows, E]`` float32 scores):
the pipeline's (:data:`routetool.engine.stream.DEFAULT_CHUNK_BYTES`) and ``info --scan``'s."""


def row_ranges(num_rows: int, row_bytes: int, budget_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of ``num_rows`` rows of at most ``budget_bytes`` each
    (``row_bytes`` a row; at least one row a range), whatever the steps: for work that is per
    row (``info --scan``), so that one huge step is read in bounded pieces."""
    step = max(1, budget_bytes // max(1, row_bytes))
    return [(a, min(a + step, num_rows)) for a in range(0, num_rows, step)]


def fmt_bytes(n: int) -> str:
    """Bytes in binary units (``1.4 MiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{int(value)} B" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def budget(input_bytes: int, per_byte: int, floor: int = BUDGET_FLOOR_BYTES) -> int:
    """Bytes an input of ``input_bytes`` may make routetool allocate: ``floor + per_byte * input_bytes``."""
    return floor + per_byte * max(int(input_bytes), 0)


def input_bytes(paths) -> int:
    """Total size of the regular files ``paths`` (a file, or the dump files of a folder); 0 for
    what cannot be examined (its reader has said why, or will)."""
    total = 0
    for p in paths:
        try:
            total += os.stat(p).st_size
        except (OSError, ValueError):
            pass
    return total


def check_expert_tables(path: object, *, experts: int, layer_steps: int, layers: int, size: int, fix: str,
                        tensor: str | None = None) -> None:
    """Refuse an input whose per-expert tables would exceed its budget (see the module docstring).

    Args:
        path: the input, as messages name it. experts: E. layer_steps: steps summed over the
            layers. layers: layers. size: the input's bytes. fix: what to do (names where E
            comes from: the metadata, the largest id, ``--num-experts``). tensor: named after
            the path (``__metadata__``).

    Raises:
        RouteToolError: naming E, the steps and layers, the bytes needed and the budget.
    """
    need = 8 * experts * (layer_steps + TABLES_PER_LAYER * layers)
    allowed = budget(size, TABLE_BYTES_PER_INPUT_BYTE)
    if need > allowed:
        raise RouteToolError(
            f"num_experts={experts:,} over {layer_steps:,} steps in {layers:,} layers would need "
            f"{fmt_bytes(need)} of per-expert tables, more than the {fmt_bytes(allowed)} an input of "
            f"{fmt_bytes(size)} may take (work must stay proportional to the data, not to num_experts)",
            path=path, tensor=tensor, fix=fix)


_DUMP_FIX = "pass an unmodified dump: torch.save of the recorder's own tensors"


def check_torch_archive(path: object, size: int) -> None:
    """Refuse a torch ``.pt`` zip archive whose records declare more bytes, uncompressed, than
    its budget, before :func:`torch.load` inflates any (a compressed record can declare a
    thousand times its size). A file that is no zip archive is left to the loader.

    Raises:
        RouteToolError: naming the declared bytes and the budget.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            declared = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return
    allowed = budget(size, MATERIALISED_PER_STORED_BYTE, MATERIALISED_FLOOR_BYTES)
    if declared > allowed:
        raise RouteToolError(f"its records declare {fmt_bytes(declared)} uncompressed, more than the "
                             f"{fmt_bytes(allowed)} a file of {fmt_bytes(size)} may take", path=path, fix=_DUMP_FIX)


def materialised_bytes(obj, path: object) -> int:
    """Bytes ``obj`` (what :func:`torch.load` returned) holds once every tensor is
    materialised, each reference counted: a tensor is ``numel * element_size`` whatever its
    strides or storage, a container its references (8 bytes each) plus what they hold.

    Shared containers are measured once and multiplied by their references (a list of a list
    of a list of 1,000 references each is 10^9, found in 3,000 steps), so the time is
    proportional to the distinct objects, as torch.load's was.

    Raises:
        RouteToolError: containers nested deeper than :data:`MAX_NESTING`, or a container
            that holds itself.
    """
    import torch

    sizes: dict[int, int] = {}
    keep = []  # (the objects measured stay alive, so that their ids stay theirs)

    def children(o):
        return list(o.keys()) + list(o.values()) if isinstance(o, dict) else list(o)

    stack = [(obj, False, 0)]
    open_ids: set[int] = set()
    while stack:
        o, done, depth = stack.pop()
        if isinstance(o, torch.Tensor):
            sizes[id(o)] = o.numel() * o.element_size()
            keep.append(o)
            continue
        if not isinstance(o, (dict, list, tuple, set, frozenset)):
            sizes.setdefault(id(o), 8)
            keep.append(o)
            continue
        key = id(o)
        if done:
            sizes[key] = 8 * len(o) + sum(sizes[id(c)] for c in children(o))
            open_ids.discard(key)
            continue
        if key in sizes:
            continue
        if key in open_ids:
            raise RouteToolError("a container in it holds itself", path=path, fix=_DUMP_FIX)
        if depth >= MAX_NESTING:
            raise RouteToolError(f"its containers are nested deeper than {MAX_NESTING} levels", path=path,
                                 fix=_DUMP_FIX)
        open_ids.add(key)
        keep.append(o)
        stack.append((o, True, depth))
        unmeasured = {id(c): c for c in children(o) if id(c) not in sizes}  # (a shared child once)
        stack.extend((c, False, depth + 1) for c in unmeasured.values())
    return sizes[id(obj)]


def check_materialised(obj, path: object, size: int) -> None:
    """Refuse a loaded ``.pt`` dump that holds more, materialised (:func:`materialised_bytes`),
    than a file of ``size`` bytes may make routetool allocate, before any of it is read.

    Raises:
        RouteToolError: naming the materialised bytes and the budget; as :func:`materialised_bytes`.
    """
    need = materialised_bytes(obj, path)
    allowed = budget(size, MATERIALISED_PER_STORED_BYTE, MATERIALISED_FLOOR_BYTES)
    if need > allowed:
        raise RouteToolError(f"holds {fmt_bytes(need)} once its tensors are materialised (expanded or stride-0 views "
                             f"and shared references counted in full), more than the {fmt_bytes(allowed)} a file of "
                             f"{fmt_bytes(size)} may take", path=path, fix=_DUMP_FIX)
