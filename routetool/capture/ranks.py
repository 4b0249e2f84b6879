"""Which process of a parallel run this is: its rank and the DP/TP/EP/PP layout around it.

A recorder in a multi-process engine writes one trace per process (``RUN/rank-<r>/``) and
puts these facts into the trace's metadata, so that the ranks' traces can later be read
together (docs/trace-format.md, "Run folders"). :func:`detect_ranks` looks, in this order, at

1. vLLM's parallel state (``vllm.distributed.parallel_state``, only when vLLM is already
   imported and its groups exist): the world group's rank and size, and the tensor-,
   pipeline-, data- and expert-parallel groups' ``rank_in_group`` / ``world_size``;
2. ``torch.distributed`` (when initialised): the global rank and world size;
3. the environment a launcher sets (torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``);
4. otherwise one process: rank 0 of 1.

Layout fields that no source gives (a plain torchrun job has no notion of TP or EP) stay
``None``: unknown, not guessed. Engines with a parallel state of their own (SGLang) pass a
:class:`RankInfo` to the recorder instead.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields

_GROUPS = (("tp", "_TP"), ("pp", "_PP"), ("dp", "_DP"), ("ep", "_EP"))


@dataclass(frozen=True)
class RankInfo:
    """One process's place in a parallel run.

    Attributes:
        rank / world_size: the process's global rank and the number of processes (the run
            folder's ``rank-<rank>``).
        local_rank: its rank on its host (the GPU it uses), when known.
        dp_rank / dp_size, tp_rank / tp_size, ep_rank / ep_size, pp_rank / pp_size: its rank
            in, and the size of, its data-, tensor-, expert- and pipeline-parallel group;
            None where unknown.
        source: where the facts came from (``vllm``, ``torch.distributed``, ``env``,
            ``single process``, ``given``).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int | None = None
    dp_rank: int | None = None
    dp_size: int | None = None
    tp_rank: int | None = None
    tp_size: int | None = None
    ep_rank: int | None = None
    ep_size: int | None = None
    pp_rank: int | None = None
    pp_size: int | None = None
    source: str = "given"

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "source" or value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RankInfo.{f.name} must be a non-negative integer or None, got {value!r}")
        if self.world_size < 1 or self.rank >= self.world_size:
            raise ValueError(f"RankInfo: rank {self.rank} is not below world_size {self.world_size}")

    def as_dict(self) -> dict[str, object]:
        """Every field, unknown ones as None (the index's ``"ranks"`` object)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def metadata(self) -> dict[str, str]:
        """The known fields as trace metadata strings (``rank``, ``world_size``, ``dp_rank``, ...)."""
        return {k: str(v) for k, v in self.as_dict().items() if v is not None and k != "source"} | {
            "rank_source": self.source}


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isascii() and value.isdigit() else None


def _from_vllm() -> RankInfo | None:
    ps = sys.modules.get("vllm.distributed.parallel_state")
    world = getattr(ps, "_WORLD", None) if ps is not None else None
    if world is None:
        return None
    facts: dict[str, int | None] = {"rank": int(world.rank), "world_size": int(world.world_size),
                                    "local_rank": getattr(world, "local_rank", None)}
    for short, name in _GROUPS:
        group = getattr(ps, name, None)
        if group is not None:
            facts[f"{short}_rank"] = int(group.rank_in_group)
            facts[f"{short}_size"] = int(group.world_size)
    return RankInfo(**facts, source="vllm")


def _from_torch() -> RankInfo | None:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return RankInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=_env_int("LOCAL_RANK"),
                    source="torch.distributed")


def _from_env() -> RankInfo | None:
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is None or world is None or rank >= world:
        return None
    return RankInfo(rank=rank, world_size=world, local_rank=_env_int("LOCAL_RANK"), source="env")


def detect_ranks() -> RankInfo:
    """This process's :class:`RankInfo`, from the first source that knows it (module docstring)."""
    for source in (_from_vllm, _from_torch, _from_env):
        info = source()
        if info is not None:
            return info
    return RankInfo(source="single process")
