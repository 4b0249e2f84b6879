"""Expert-parallel placement: rank loads, balancedness, and the EPLB replication/packing.

Vocabulary (docs/balance.md): a *logical* expert is one of the model's E routed experts; a
*physical* expert is one slot holding a copy (*replica*) of a logical expert on an EP rank
(GPU). With ``R`` redundant experts there are ``P = E + R`` physical slots, ``P / G`` per
GPU. A placement maps every physical slot to its logical expert
(``physical_to_logical_map``, ``[L, P]``); GPU ``g`` owns slots ``[g * P/G, (g+1) * P/G)``.

The tokens of a logical expert with ``c`` replicas are assumed to be split evenly among
them (``load / c`` per replica), the model EPLB optimises and that engines approximate
by spreading tokens over replicas. The load of an EP rank is the sum of its slots' loads,
and **balancedness** is ``mean / max`` of the rank loads (1.0 = perfectly even), as vLLM
and SGLang log it.

EPLB is an independent implementation of the algorithm DeepSeek published as the Expert
Parallelism Load Balancer: https://github.com/deepseek-ai/EPLB (``eplb.py``,
``rebalance_experts``), the redundant-experts deployment of DeepSeek-AI, "DeepSeek-V3
Technical Report", arXiv:2412.19437, sec. 3.4. Written from its description:

* **balanced packing**: items, heaviest first, each go to the lightest pack that still has
  room; every pack gets the same number of items;
* **replication**: each redundant slot goes, one at a time, to the logical expert with the
  largest load per replica;
* **hierarchical policy** (used when the number of expert groups is a multiple of the number
  of nodes): pack expert groups onto nodes (balanced packing of group loads), replicate
  experts within each node, then pack each node's physical experts onto its GPUs;
* **global policy**: replicate over all experts, then pack onto all GPUs (the hierarchical
  policy with one group and one node).

Ties are broken deterministically (lowest index first), which the original leaves to the
sort; placements can therefore differ from it on exactly tied loads, not in quality.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from routetool.errors import RouteToolError
from routetool.io.jsonstrict import load_file

PLACEMENT_SCHEMA = "routetool.placement/1"
POLICIES = ("auto", "hierarchical", "global")
MAX_REDUNDANT_PER_EXPERT = 3
"""At most this many redundant experts per logical expert (``R <= 3 E``, ``P <= 4 E`` slots).

Every redundant slot holds a full copy of an expert's weights, so deployments replicate a
fraction of the experts (DeepSeek-V3: 32 redundant for 256 experts; the vLLM and SGLang
examples likewise); at ``R = E`` in-sample balancedness is already 1.0 on real traffic. The
bound keeps a typo (``--redundant 100000000``) from running for hours: replication gives
the slots out one at a time, so the cost grows with ``R``."""


def max_redundant(num_experts: int) -> int:
    """The most redundant experts EPLB accepts for ``num_experts`` logical experts."""
    return MAX_REDUNDANT_PER_EXPERT * num_experts


# ---------------------------------------------------------------------------------------
# balancedness and rank loads
def balancedness(rank_loads: torch.Tensor) -> torch.Tensor:
    """``mean / max`` over the last dimension (EP ranks); NaN where every rank has 0 load.

    Args:
        rank_loads: ``[..., N]`` loads (tokens) of N EP ranks, any real dtype.

    Returns:
        ``[...]`` float64 in ``[1/N, 1]`` (NaN for an all-zero row).
    """
    x = rank_loads.double()
    peak = x.amax(dim=-1)
    mean = x.mean(dim=-1)
    return torch.where(peak > 0, mean / torch.where(peak > 0, peak, 1.0), float("nan"))


def share_matrix(physical_to_logical: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """``[E, N]`` fraction of each logical expert's tokens that lands on each EP rank.

    A logical expert with ``c`` replicas sends ``1/c`` of its tokens to each replica's rank.
    ``counts @ share_matrix(...)`` gives the rank loads of any ``[..., E]`` load histogram.

    Args:
        physical_to_logical: ``[P]`` int, the logical expert of each physical slot.
        num_experts: E. num_ranks: N (GPUs); ``P`` must be a multiple of ``N``.
    """
    phy = physical_to_logical.long().cpu()
    P = int(phy.numel())
    slots = P // num_ranks
    replicas = torch.bincount(phy, minlength=num_experts).double()
    rank_of_slot = torch.arange(P) // slots
    m = torch.zeros(num_experts, num_ranks, dtype=torch.float64)
    m.index_put_((phy, rank_of_slot), 1.0 / replicas[phy], accumulate=True)
    return m


# ---------------------------------------------------------------------------------------
# placements
@dataclass
class Placement:
    """Where the physical experts of every layer live.

    Attributes:
        layers: layer ids, one per row of the maps.
        physical_to_logical: ``[L, P]`` int64 logical expert of each physical slot; GPU
            ``g`` holds slots ``[g * P/G, (g+1) * P/G)``.
        replica_rank: ``[L, P]`` int64, which replica of its logical expert a slot is
            (0 for the first copy).
        logical_count: ``[L, E]`` int64 replicas per logical expert (>= 1).
        num_gpus: G, EP ranks. num_nodes: nodes (G a multiple). num_groups: expert groups.
        policy: ``contiguous`` (no replication, expert ``e`` on GPU ``e // (E/G)``),
            ``hierarchical``, ``global`` or ``file`` (read from a placement file).
        name: how the placement is shown in reports.
    """

    layers: list[int]
    physical_to_logical: torch.Tensor
    replica_rank: torch.Tensor
    logical_count: torch.Tensor
    num_gpus: int
    num_nodes: int = 1
    num_groups: int = 1
    policy: str = "contiguous"
    name: str = "contiguous"

    @property
    def num_logical(self) -> int:
        return int(self.logical_count.shape[1])

    @property
    def num_physical(self) -> int:
        return int(self.physical_to_logical.shape[1])

    @property
    def experts_per_gpu(self) -> int:
        return self.num_physical // self.num_gpus

    @property
    def has_replicas(self) -> bool:
        return self.num_physical != self.num_logical

    def row(self, layer: int) -> int:
        """Row of ``layer`` in the maps. Raises KeyError for a layer the placement lacks."""
        try:
            return self.layers.index(layer)
        except ValueError:
            raise KeyError(layer) from None

    def share_matrix(self, layer: int) -> torch.Tensor:
        """``[E, G]`` share of each logical expert's tokens per GPU for ``layer``."""
        return share_matrix(self.physical_to_logical[self.row(layer)], self.num_logical, self.num_gpus)

    def rank_of_expert(self, layer: int) -> torch.Tensor | None:
        """``[E]`` GPU of each logical expert when no expert is replicated, else None."""
        if self.has_replicas:
            return None
        phy = self.physical_to_logical[self.row(layer)]
        out = torch.empty(self.num_logical, dtype=torch.int64)
        out[phy] = torch.arange(self.num_physical) // self.experts_per_gpu
        return out

    def logical_to_physical(self) -> torch.Tensor:
        """``[L, E, max replicas]`` int64 physical slots of each logical expert, -1 padded."""
        L, P = self.physical_to_logical.shape
        width = int(self.logical_count.max()) if self.logical_count.numel() else 1
        out = torch.full((L, self.num_logical, width), -1, dtype=torch.int64)
        for i in range(L):
            out[i, self.physical_to_logical[i], self.replica_rank[i]] = torch.arange(P)
        return out

    def replicated(self, layer: int) -> list[tuple[int, int]]:
        """``(logical expert, replicas)`` of the experts with more than one replica, most first."""
        cnt = self.logical_count[self.row(layer)]
        order = torch.argsort(-cnt, stable=True)
        return [(int(e), int(cnt[e])) for e in order.tolist() if cnt[e] > 1]


def contiguous_placement(layers: list[int], num_experts: int, num_gpus: int) -> Placement:
    """The default EP placement: expert ``e`` on GPU ``e // (E / G)``, no replicas.

    Raises:
        RouteToolError: E is not a multiple of G.
    """
    if num_gpus < 1 or num_experts % num_gpus:
        raise RouteToolError(
            f"--ep-size {num_gpus}: {num_experts} experts cannot be split evenly over {num_gpus} EP ranks",
            fix=f"choose an EP size that divides {num_experts}",
        )
    L = len(layers)
    phy = torch.arange(num_experts).repeat(L, 1)
    return Placement(
        layers=list(layers), physical_to_logical=phy, replica_rank=torch.zeros_like(phy),
        logical_count=torch.ones(L, num_experts, dtype=torch.int64), num_gpus=num_gpus,
        policy="contiguous", name=f"contiguous ep={num_gpus}",
    )


# ---------------------------------------------------------------------------------------
# EPLB building blocks (one layer at a time; loads are float64 on the CPU)
def balanced_packing(weights: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``n`` weighted items into ``num_packs`` packs of ``n / num_packs`` items each.

    Greedy, as in DeepSeek's EPLB: items by decreasing weight (ties: lower index first)
    each go to the currently lightest pack that is not full (ties: lower pack index).

    Args:
        weights: ``[n]`` item weights (tokens). num_packs: m, must divide n.

    Returns:
        ``(pack_index, rank_in_pack)``: ``[n]`` int64 each, the pack of every item and its
        position inside the pack (in the order items were added).
    """
    n = int(weights.numel())
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"{n} items cannot be packed evenly into {num_packs} packs")
    per_pack = n // num_packs
    pack_index = torch.empty(n, dtype=torch.int64)
    rank_in_pack = torch.empty(n, dtype=torch.int64)
    if per_pack == 1:
        # one item per pack: keep the items in place (any assignment is equally balanced)
        pack_index[:] = torch.arange(n)
        rank_in_pack[:] = 0
        return pack_index, rank_in_pack
    w = weights.double().cpu().tolist()
    order = sorted(range(n), key=lambda i: (-w[i], i))
    load = [0.0] * num_packs
    size = [0] * num_packs
    for item in order:
        pack = min((p for p in range(num_packs) if size[p] < per_pack), key=lambda p: (load[p], p))
        pack_index[item] = pack
        rank_in_pack[item] = size[pack]
        load[pack] += w[item]
        size[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weights: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give ``num_physical - n`` extra replicas to minimise the largest load per replica.

    Each redundant slot goes to the logical expert whose ``load / replicas`` is largest at
    that moment (ties: lower index), as in DeepSeek's EPLB.

    Args:
        weights: ``[n]`` logical expert loads. num_physical: slots, ``>= n``.

    Returns:
        ``(physical_to_logical [num_physical], replica_rank [num_physical], count [n])``,
        int64; the first ``n`` slots hold experts ``0..n-1`` in order, then the replicas in
        the order they were added.
    """
    n = int(weights.numel())
    if num_physical < n:
        raise ValueError(f"{num_physical} physical slots cannot hold {n} experts")
    w = weights.double().cpu()
    phy = torch.empty(num_physical, dtype=torch.int64)
    phy[:n] = torch.arange(n)
    rank = torch.zeros(num_physical, dtype=torch.int64)
    count = torch.ones(n, dtype=torch.int64)
    for slot in range(n, num_physical):
        e = int(torch.argmax(w / count))  # argmax returns the first maximum
        phy[slot] = e
        rank[slot] = count[e]
        count[e] += 1
    return phy, rank, count


def _rebalance_layer(weights: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                     num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hierarchical EPLB for one layer (global = one group, one node).

    Returns ``(physical_to_logical [P], replica_rank [P], logical_count [E])``.
    """
    E = int(weights.numel())
    w = weights.double().cpu()
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = E // num_nodes
    phys_per_node = num_physical // num_nodes
    gpus_per_node = num_gpus // num_nodes
    phys_per_gpu = num_physical // num_gpus

    # 1. expert groups onto nodes, balancing the nodes' loads
    group_load = w.view(num_groups, group_size).sum(-1)
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    # node-local ("middle") numbering of logical experts: node n holds middle ids
    # [n * E/nodes, (n+1) * E/nodes), its groups in the order they were packed
    group_slot = group_node * groups_per_node + group_rank                      # [groups]
    log_to_mid = (group_slot[:, None] * group_size + torch.arange(group_size)).reshape(-1)  # [E]
    mid_to_log = torch.empty_like(log_to_mid)
    mid_to_log[log_to_mid] = torch.arange(E)

    phy_to_log = torch.empty(num_physical, dtype=torch.int64)
    phy_rank = torch.empty(num_physical, dtype=torch.int64)
    log_count = torch.empty(E, dtype=torch.int64)
    for node in range(num_nodes):
        mids = torch.arange(node * experts_per_node, (node + 1) * experts_per_node)
        node_log = mid_to_log[mids]                                            # logical ids on this node
        node_w = w[node_log]
        # 2. replicate within the node
        rep_phy, rep_rank, rep_cnt = replicate_experts(node_w, phys_per_node)
        log_count[node_log] = rep_cnt
        # 3. pack the node's physical experts onto its GPUs by load per replica
        per_replica = node_w[rep_phy] / rep_cnt[rep_phy].double()
        gpu, pos = balanced_packing(per_replica, gpus_per_node)
        slot = node * phys_per_node + gpu * phys_per_gpu + pos                 # global physical index
        phy_to_log[slot] = node_log[rep_phy]
        phy_rank[slot] = rep_rank
    return phy_to_log, phy_rank, log_count


def check_eplb_config(num_experts: int, num_redundant: int, num_groups: int, num_nodes: int,
                      num_gpus: int, policy: str, *, redundant_implied_by: str | None = None) -> str:
    """Validate an EPLB configuration and resolve ``policy`` (auto|hierarchical|global).

    ``auto`` is DeepSeek's rule: hierarchical when the number of nodes divides the number of
    expert groups (and there is more than one node), else global.

    ``redundant_implied_by``: the option that gave ``num_gpus`` (``--gpus``) when
    ``num_redundant`` is not given but its default, one redundant expert per GPU; messages
    then name that option, which the user gave, instead of ``--redundant``.

    Returns:
        ``"hierarchical"`` or ``"global"``.

    Raises:
        RouteToolError: more than :func:`max_redundant` redundant experts (checked first, so
            a huge count fails at once); an impossible combination, with the constraint that
            fails.
    """
    if policy not in POLICIES:
        raise RouteToolError(f"unknown EPLB policy {policy!r}", fix="use auto, hierarchical or global")
    limit = max_redundant(num_experts)
    if num_redundant > limit:
        over = (f"over the limit of {limit:,} redundant experts ({MAX_REDUNDANT_PER_EXPERT} per logical expert, "
                f"{num_experts} experts)")
        if redundant_implied_by is not None:
            raise RouteToolError(f"EPLB: {redundant_implied_by} {num_gpus} implies --redundant {num_redundant} by "
                                 f"default (one redundant expert per GPU), {over}",
                                 fix=f"pass fewer {redundant_implied_by}, or an explicit --redundant of at most {limit:,}")
        raise RouteToolError(f"EPLB: --redundant {num_redundant} is {over}",
                             fix=f"pass --redundant {limit} or fewer; deployments replicate a fraction of the experts")
    P = num_experts + num_redundant
    problems = []
    if num_redundant < 0:
        problems.append(f"redundant experts {num_redundant} must be >= 0")
    if num_gpus < 1 or P % num_gpus:
        default = ", one per GPU by default" if redundant_implied_by is not None else ""
        problems.append(f"{P} physical experts ({num_experts} + {num_redundant} redundant{default}) must be a "
                        f"multiple of the {num_gpus} GPUs")
    if num_nodes < 1 or num_gpus % num_nodes:
        problems.append(f"{num_gpus} GPUs must be a multiple of the {num_nodes} nodes")
    if num_groups < 1 or num_experts % num_groups:
        problems.append(f"{num_experts} experts must be a multiple of the {num_groups} expert groups")
    if problems:
        raise RouteToolError("EPLB: " + "; ".join(problems),
                             fix="adjust --redundant, --gpus, --nodes or --groups")
    if policy == "auto":
        policy = "hierarchical" if num_nodes > 1 and num_groups % num_nodes == 0 else "global"
    if policy == "hierarchical":
        if num_groups % num_nodes:
            raise RouteToolError(f"EPLB hierarchical: {num_groups} expert groups cannot be split over {num_nodes} nodes",
                                 fix="use --eplb-policy global, or a number of nodes that divides the groups")
        if P % num_nodes or (P // num_nodes) < (num_experts // num_nodes):
            raise RouteToolError(f"EPLB hierarchical: {P} physical experts cannot be split over {num_nodes} nodes",
                                 fix="make the redundant experts a multiple of the nodes")
    return policy


def rebalance_experts(
    weights: torch.Tensor,
    num_redundant: int,
    *,
    num_gpus: int,
    num_nodes: int = 1,
    num_groups: int = 1,
    policy: str = "auto",
    layers: list[int] | None = None,
) -> Placement:
    """EPLB: replicate hot experts and place all replicas on GPUs to balance their loads.

    An independent implementation of DeepSeek's ``rebalance_experts``
    (https://github.com/deepseek-ai/EPLB; DeepSeek-V3 Technical Report, arXiv:2412.19437,
    sec. 3.4); see the module docstring for the algorithm.

    Args:
        weights: ``[L, E]`` expected load (tokens) of each logical expert per layer.
        num_redundant: R extra physical slots (``P = E + R`` slots in total).
        num_gpus: G EP ranks; ``P`` must be a multiple. num_nodes: nodes, dividing G.
        num_groups: expert groups (DeepSeek-V3: 8 of 32 experts), dividing E.
        policy: ``auto`` (DeepSeek's rule), ``hierarchical`` or ``global``.
        layers: layer ids of the rows (default ``0..L-1``).

    Returns:
        A :class:`Placement` with policy ``hierarchical`` or ``global``.

    Raises:
        RouteToolError: an impossible configuration (see :func:`check_eplb_config`).
    """
    if weights.dim() != 2:
        raise ValueError(f"weights must be [layers, experts], got {list(weights.shape)}")
    L, E = weights.shape
    resolved = check_eplb_config(E, num_redundant, num_groups, num_nodes, num_gpus, policy)
    groups, nodes = (num_groups, num_nodes) if resolved == "hierarchical" else (1, 1)
    P = E + num_redundant
    phy = torch.empty(L, P, dtype=torch.int64)
    rank = torch.empty(L, P, dtype=torch.int64)
    cnt = torch.empty(L, E, dtype=torch.int64)
    for i in range(L):
        phy[i], rank[i], cnt[i] = _rebalance_layer(weights[i], P, groups, nodes, num_gpus)
    return Placement(
        layers=list(layers) if layers is not None else list(range(L)),
        physical_to_logical=phy, replica_rank=rank, logical_count=cnt,
        num_gpus=num_gpus, num_nodes=num_nodes, num_groups=num_groups, policy=resolved,
        name=f"EPLB {resolved} G={num_gpus} R={num_redundant}",
    )


# ---------------------------------------------------------------------------------------
# placement files
def placement_document(placement: Placement, **extra) -> dict:
    """The placement as the documented JSON document (``routetool.placement/1``)."""
    return {
        "schema": PLACEMENT_SCHEMA,
        "policy": placement.policy,
        "num_logical_experts": placement.num_logical,
        "num_physical_experts": placement.num_physical,
        "num_redundant_experts": placement.num_physical - placement.num_logical,
        "num_gpus": placement.num_gpus,
        "num_nodes": placement.num_nodes,
        "num_groups": placement.num_groups,
        "experts_per_gpu": placement.experts_per_gpu,
        "layers": list(placement.layers),
        "physical_to_logical_map": placement.physical_to_logical.tolist(),
        "logical_to_physical_map": placement.logical_to_physical().tolist(),
        "logical_replica_count": placement.logical_count.tolist(),
        **extra,
    }


def load_placement(path: str | Path, num_experts: int, layers: list[int], num_gpus: int | None = None) -> Placement:
    """Read a placement JSON (``routetool.placement/1``, or any JSON object with a
    ``physical_to_logical_map`` and no ``schema``) for the given layers.

    ``physical_to_logical_map`` holds one row (a list of P logical expert ids) per layer, as
    vLLM's and SGLang's map of that name. Rows are matched to layers by the file's ``layers``
    list; without one, a single row applies to every layer, and otherwise there must be one
    row per analysed layer, in order. The GPU count comes from ``num_gpus`` in the file, else
    from ``num_gpus``.

    Raises:
        RouteToolError: unreadable file (a FIFO, device or socket included), a ``schema``
            other than :data:`PLACEMENT_SCHEMA`, a flat ``physical_to_logical_map`` (one
            list of ids instead of one list per layer), missing keys, values of the wrong type (ids that are
            not integers, ``num_gpus`` that is not a positive integer ...), a layer without a
            row, a logical expert with no slot, more than :func:`max_redundant` redundant
            slots, slots not divisible by the GPUs; one line
            naming the key and the element.
    """
    path = Path(path)
    fix_file = "fix the file, or write one with `routetool balance --eplb-out`"
    doc = load_file(path, fix="pass a placement file written by `routetool balance --eplb-out`")
    if isinstance(doc, dict) and "schema" in doc and doc["schema"] != PLACEMENT_SCHEMA:
        raise RouteToolError(f"schema is {_short(doc['schema'])}; expected {json.dumps(PLACEMENT_SCHEMA)}", path=path,
                             fix="pass a placement written by `routetool balance --eplb-out`, or a file in its format")
    if not isinstance(doc, dict) or "physical_to_logical_map" not in doc:
        raise RouteToolError("has no physical_to_logical_map", path=path,
                             fix="pass a placement written by `routetool balance --eplb-out`")
    raw = doc["physical_to_logical_map"]
    if isinstance(raw, list) and raw and not any(isinstance(r, list) for r in raw):
        raise RouteToolError(f"physical_to_logical_map is one flat list of {len(raw)} values; expected one list of "
                             "logical expert ids per layer ([[...], ...], as vLLM and SGLang write it)", path=path,
                             fix="write one row per layer, or [[...]] for one row that applies to every layer")
    if not isinstance(raw, list) or not raw or not all(isinstance(r, list) and r for r in raw):
        raise RouteToolError("physical_to_logical_map is not a non-empty list of non-empty integer lists", path=path,
                             fix=fix_file)
    if len({len(r) for r in raw}) != 1:
        raise RouteToolError(f"physical_to_logical_map rows have different lengths ({sorted({len(r) for r in raw})})",
                             path=path, fix=fix_file)
    limit = max_redundant(num_experts)
    if len(raw[0]) - num_experts > limit:  # before the per-slot checks, as for --redundant
        raise RouteToolError(f"physical_to_logical_map has {len(raw[0]):,} slots per layer for {num_experts} experts: "
                             f"over the limit of {limit:,} redundant experts ({MAX_REDUNDANT_PER_EXPERT} per logical "
                             "expert)", path=path, fix=f"use a placement with at most {num_experts + limit:,} slots "
                             "per layer")
    for i, r in enumerate(raw):
        for j, e in enumerate(r):
            if not _is_int(e):
                raise RouteToolError(f"physical_to_logical_map[{i}][{j}] is {json.dumps(e)}: logical expert ids are "
                                     "integers", path=path, fix=fix_file)
            if not 0 <= e < num_experts:
                raise RouteToolError(f"physical_to_logical_map[{i}][{j}] is {e}: outside [0, {num_experts})", path=path,
                                     fix=f"the input has {num_experts} experts; use a placement made for it")
    rows = torch.tensor(raw, dtype=torch.int64)
    file_layers = doc.get("layers")
    if file_layers is not None:
        if not isinstance(file_layers, list) or not all(_is_int(x) and x >= 0 for x in file_layers):
            raise RouteToolError(f"'layers' is {_short(file_layers)}; expected a list of non-negative integer layer ids",
                                 path=path, fix=fix_file)
        if len(set(file_layers)) != len(file_layers):
            raise RouteToolError("'layers' lists a layer twice", path=path, fix=fix_file)
        if len(file_layers) != rows.shape[0]:
            raise RouteToolError(f"lists {len(file_layers)} layers but physical_to_logical_map has {rows.shape[0]} rows",
                                 path=path, fix="fix the file")
        index = {int(x): i for i, x in enumerate(file_layers)}
        missing = [x for x in layers if x not in index]
        if missing:
            raise RouteToolError(f"has no placement for layer(s) {', '.join(map(str, missing))}", path=path,
                                 fix="choose the layers with --layers, or export a placement for them")
        chosen = rows[[index[x] for x in layers]]
    elif rows.shape[0] == 1:
        chosen = rows.expand(len(layers), -1).clone()
    elif rows.shape[0] == len(layers):
        chosen = rows
    else:
        raise RouteToolError(f"has {rows.shape[0]} rows and no 'layers' list, but {len(layers)} layers are analysed",
                             path=path, fix="add a 'layers' list to the file")
    if "num_gpus" in doc and doc["num_gpus"] is not None:
        G = doc["num_gpus"]
        if not _is_int(G) or G < 1:
            raise RouteToolError(f"num_gpus is {json.dumps(G)}; expected a positive integer", path=path, fix=fix_file)
    elif num_gpus is not None:
        G = num_gpus
    else:
        raise RouteToolError("does not say num_gpus", path=path, fix="add num_gpus to the file or pass one --ep-size")
    extra = {}
    for key in ("num_nodes", "num_groups"):
        value = doc.get(key, 1)
        if value is None:
            value = 1
        if not _is_int(value) or value < 1:
            raise RouteToolError(f"{key} is {json.dumps(value)}; expected a positive integer", path=path, fix=fix_file)
        extra[key] = value
    P = chosen.shape[1]
    if P % G:
        raise RouteToolError(f"{P} physical experts are not a multiple of num_gpus={G}", path=path, fix="fix the file")
    counts = torch.stack([torch.bincount(r, minlength=num_experts) for r in chosen])
    if (counts == 0).any():
        i, e = (counts == 0).nonzero()[0].tolist()
        raise RouteToolError(f"layer {layers[i]}: logical expert {e} has no physical slot", path=path,
                             fix="every expert needs at least one replica")
    replica_rank = torch.zeros_like(chosen)
    for i in range(chosen.shape[0]):
        seen = torch.zeros(num_experts, dtype=torch.int64)
        for s, e in enumerate(chosen[i].tolist()):
            replica_rank[i, s] = seen[e]
            seen[e] += 1
    return Placement(
        layers=list(layers), physical_to_logical=chosen, replica_rank=replica_rank, logical_count=counts,
        num_gpus=G, num_nodes=extra["num_nodes"], num_groups=extra["num_groups"],
        policy="file", name=f"{path.name} ep={G}",
    )


def _is_int(value) -> bool:
    """A JSON integer (not a bool, not a float such as 0.5 or 2.0)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value, limit: int = 40) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def finite_or_none(x: float) -> float | None:
    """``x`` as a float, or None when it is NaN/inf (e.g. balancedness of an empty step)."""
    x = float(x)
    return x if math.isfinite(x) else None
