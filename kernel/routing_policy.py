"""Launch settings of the tiled variant: :class:`LaunchConfig`, the shape-chosen default and its switches.

Host side only (torch, no Triton): what :func:`routetool_kernels.routing.fused_musespark1x_routing` asks
of the kernels in :mod:`routetool_kernels.routing_jit`. :func:`default_config` picks the algorithm and
grid from the batch's shape, :func:`check_launch_config` says whether a config fits it,
:func:`tile_counters` holds the atomic counters of dynamic-tile launches.

The module-level switches (:data:`SMALL_BATCH`, :data:`PERSISTENT_FROM`,
:data:`TWO_LEVEL_MAX_TOPK`, :data:`DYNAMIC_TILES_FROM`, :data:`PING_PONG_MAX_SLICES`,
:data:`TILE_GROUPS`, :data:`ROWS_LAUNCHES`, :data:`ROWS_FP32_LAUNCHES`, :data:`ROWS_FP32_TILED_FROM`,
:data:`ROWS_FP32_TILED_LAUNCHES`, :data:`ROWS_FP32_PAIR_TILE`, :data:`ROWS_AHEAD`, :data:`ROWS_AHEAD_FROM`,
:data:`ROWS_TILE`, :data:`ROWS_TMA_FROM`, :data:`ROWS_TMA_TILE`, :data:`ROWS_TMA_STAGES`, :data:`ROWS_REDO_OWN_LOADS`,
:data:`ROWS_WORDS`) are read from this module on every checked call, so experiments and
tests set them here (``routetool_kernels.routing`` shows them, read-only) and then call
:func:`routetool_kernels._dispatch.clear_plans`, since a plan keeps the settings it was made with.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class LaunchConfig:
    """Launch settings of :func:`routetool_kernels.routing.fused_musespark1x_routing`.

    Attributes:
        block_t: tokens per program, or per loop iteration of a persistent program
            (power of two).
        chunk: ``"scan"``: contiguous experts per innermost tile run; ``"two_level"``: columns
            per row (power of two, <= padded experts); ``"rows"``: threads per token (1 to 8).
        num_warps: warps per program.
        algorithm: ``"scan"`` (``topk`` rounds over every expert of the row),
            ``"two_level"`` (per-column best two, then a merge of the columns; see
            :func:`routetool_kernels.routing_jit._two_level_kernel`) or ``"rows"`` (one thread per token,
            sorting networks; sigmoid, ``topk`` <= 8, <= 256 experts; ``block_t = 32 * num_warps / chunk``;
            see :func:`routetool_kernels.routing_jit._rows_kernel`).
        programs_per_sm: ``"two_level"`` only: a persistent grid of this many programs per
            streaming multiprocessor (0: one program per ``block_t`` tokens).
        max_registers: registers per thread the compiler may use (``maxnreg``; 0: its
            choice). Fewer registers let more programs reside on an SM.
        dynamic_tiles: ``"two_level"`` on a persistent grid only: each program takes its first
            two tiles by index and claims the rest from atomic counters (two at a time where
            the persistent loop holds two tiles, :data:`PING_PONG_MAX_SLICES`, one at a time
            for more experts; :func:`routetool_kernels.routing_jit._two_level_kernel`), so that programs
            that started early or met easy tiles take more and all end together. Applies where
            programs average at least :data:`DYNAMIC_TILES_FROM` tiles and the launch has its
            stream's counters (see :func:`tile_counters`); elsewhere the launch takes every
            grid-th tile.
    """

    block_t: int
    chunk: int
    num_warps: int
    algorithm: str = "scan"
    programs_per_sm: int = 0
    max_registers: int = 0
    dynamic_tiles: bool = False

    @cached_property
    def _signature(self) -> tuple:
        """The config in a launcher's plan key: each field with its class (``32`` and ``32.0``
        are equal configs, but only one passes :func:`check_launch_config`)."""
        return tuple((v.__class__, v) for v in (self.block_t, self.chunk, self.num_warps, self.algorithm,
                                                self.programs_per_sm, self.max_registers, self.dynamic_tiles))


ALGORITHMS = ("scan", "two_level", "rows")

ROWS_MAX_TOPK = 8
"""Largest ``topk`` of the rows algorithm (it keeps each token's best 8 keys)."""

ROWS_LAUNCHES = ((8192, 2, 1), (0, 8, 1))
"""The rows algorithm's default launches for bf16/fp16 logits, ``(above this many tokens, threads a token, warps a
program)``, the first that applies. One-warp programs: the unproven vote is then a warp's, with no barrier, which
took 65536 x 256 bf16 from 24.5 us (two threads a token, 4 warps) to 20.1 on an H200 (benchmarks/NOTES.md, v13, 256
experts, four chunks ahead). v15 (H200): two threads a token at 65536 and 16384 tokens (256 experts 19.7, 7.1 us;
four 21.4, 8.5; eight 26.2, 7.7), eight at 4096 (3.0 us; four 3.3; 128 experts 2.4 against 2.5)."""

ROWS_FP32_LAUNCHES = ((32768, 2, 1), (8192, 4, 1), (0, 8, 1))
"""The rows algorithm's launches for float32 logits of fewer than :data:`ROWS_FP32_TILED_FROM` experts: two threads
a token through coalesced tiles (:data:`ROWS_FP32_PAIR_TILE`) above 32768 tokens, below that each thread loading its
own 16-byte pieces, two a chunk. On an H200 at 128 experts (v15) four threads a token 17.3 / 5.6 us at 65536 / 16384
tokens (two 21.2 / 6.8), eight 3.0 us at 4096 (four 3.3); two-level 25.2 / 8.3 / 5.3; v16 sweep (with a switch
since removed): two threads through tiles of two chunks 14.7 / 5.8 us at 65536 / 16384 (four threads 17.1 / 5.5);
15.5 us at 65536 in the table at 63b229e (17.5 at de15553)."""

ROWS_FP32_PAIR_TILE = 2
"""Chunks of 8 experts a thread takes from each coalesced tile for float32 logits of fewer than
:data:`ROWS_FP32_TILED_FROM` experts at two threads a token or fewer (:data:`ROWS_FP32_LAUNCHES` above 32768 tokens):
each thread reads 64 bytes of a 128-byte tile of its row (with its own loads, 32 a chunk)."""

ROWS_FP32_TILED_FROM = 129
"""Experts from which float32 logits reach the rows algorithm through coalesced tiles (``TILE`` 1: a program's rows
loaded ``LANES * 32`` bytes a row at a time (128 at four threads a token, 256 at eight) and moved into the threads through shared memory) with
:data:`ROWS_FP32_TILED_LAUNCHES`: on an H200 at 256 experts 29.5 / 9.6 / 4.9 us at 65536 / 16384 / 4096 tokens,
two-level 32.4 / 10.8 / 5.3, the threads' own loads 35.5 / 12.1 / 5.4 (v12)."""

ROWS_FP32_TILED_LAUNCHES = ((32768, 4, 1), (0, 8, 1))
"""The rows algorithm's launches for float32 logits of :data:`ROWS_FP32_TILED_FROM` experts and more: one-warp
programs, on an H200 at 256 experts (v15) four threads a token 26.3 us at 65536 tokens (4 warps: 30.2; eight
threads 29.2), eight 9.6 / 4.0 us at 16384 / 4096 (four threads 11.9 / 5.8; 4 warps 10.2 / 4.9). v16, with the vote
one ``REDUX``: four threads 8.38 us at 16384 (sweep), eight 8.92 (table); the switch at 32768 is due a re-time."""

ROWS_AHEAD = 4
"""Chunks of 8 experts a thread of the rows algorithm loads ahead of the one it sorts, for 16-bit logits where a
thread takes at least :data:`ROWS_AHEAD_FROM` chunks (elsewhere 1): 4, or 2 or 1 where that does not divide the
chunks a thread takes (each of its loop's steps reloads that many registers in place). On an H200 (v13, one-warp
programs) four ahead took 4096 x 256 bf16 (four threads a token) from 4.0 us with two ahead to 3.3, 16384 x 256 (two
threads) from 8.8 to 7.2, 65536 x 256 20.1 against 20.2; float32 logits gain nothing (v12: slower)."""

ROWS_AHEAD_FROM = 8
"""Fewest chunks a thread takes for :data:`ROWS_AHEAD` to apply."""

ROWS_TILE = 0
"""Chunks of 8 experts a thread of the rows algorithm takes from each tile of logits its program loads
coalesced (the tile moves through shared memory into the threads' registers) where float32 logits do not take
:data:`ROWS_FP32_TILED_FROM`'s tiles of one chunk or :data:`ROWS_FP32_PAIR_TILE`'s; 0: each thread loads its own
chunks, 16 bytes at a time."""

ROWS_TMA_FROM = 32768
"""Tokens above which bf16 logits read as words (:data:`ROWS_WORDS`) reach the rows algorithm through the
tensor-memory accelerator (Hopper's TMA) where the rows, the bias and the expert count allow it
(:func:`routetool_kernels.routing._row_tma`): tiles of :data:`ROWS_TMA_TILE` chunks a thread, :data:`ROWS_TMA_STAGES`
in flight, copied into shared memory without a per-thread load (0: never). The selection alone on an H200 at 65536 x
256 bf16 (benchmarks/bench_rows_floor.py, HBM inputs): 18.71 us against 20.05 with the threads' own loads, 18.15
started early (PDL); 65536 x 128: 11.30 against 12.55."""

ROWS_TMA_TILE = 4
"""Chunks of 8 experts a thread takes from each tile of a :data:`ROWS_TMA_FROM` launch (a tile row of
``LANES * 4 * 16`` bytes; on an H200 at 256 experts tiles of 2 / 4 / 8: 19.74 / 18.71 / 19.21 us)."""

ROWS_TMA_STAGES = 3
"""Tiles in flight in a :data:`ROWS_TMA_FROM` launch (on an H200 at 256 experts 2 / 3 / 4 stages: 18.97 / 18.71 /
21.09 us)."""

ROWS_REDO_OWN_LOADS = 0
"""Whether the rows algorithm's exact redo reads each thread's own 16-byte pieces, one chunk at a time, instead of
the launch's own path (tiles, chunks ahead). The redo's 64-bit keys set the kernel's register count (SASS for sm_90,
Triton 3.9, ``benchmarks/inspect_rows.py``): the TMA launch takes 92 registers at 256 experts and 128 at 128 (21 and
16 one-warp programs an SM), 64 at both with this switch (32, the whole 65536-token grid in one wave), with its loop
the same instructions; the threads' own loads 80 / 112 and 72. The picks are exact either way (the same bits).
On an H100 (benchmarks/NOTES.md, v18) 65536 x 256 bf16 took 21.21 us with it against 20.42, 65536 x 128 12.55
against 12.72: off until an H200 times it."""

ROWS_WORDS = 1
"""Whether the rows algorithm reads bf16 logits as int32 words of two (one instruction per logit to float32)."""

ROWS_MAX_EXPERTS = 256
"""Most experts of the rows algorithm: its window keys hold the expert in their low ``INDEX_BITS`` bits
(:func:`rows_index_bits`) and the score in the other ``32 - INDEX_BITS``, at least two binades."""


def rows_launches(num_experts: int, gating_dtype: torch.dtype) -> tuple[tuple[int, int, int], ...]:
    """The rows algorithm's launch table for these logits: :data:`ROWS_LAUNCHES`, :data:`ROWS_FP32_LAUNCHES` or
    :data:`ROWS_FP32_TILED_LAUNCHES`."""
    if gating_dtype.itemsize < 4:
        return ROWS_LAUNCHES
    return ROWS_FP32_TILED_LAUNCHES if num_experts >= ROWS_FP32_TILED_FROM else ROWS_FP32_LAUNCHES


def rows_switches() -> set[int]:
    """Every batch size at which a rows launch table switches (the tokens above which an entry applies)."""
    return {above for table in (ROWS_LAUNCHES, ROWS_FP32_LAUNCHES, ROWS_FP32_TILED_LAUNCHES)
            for above, _, _ in table if above} | ({ROWS_TMA_FROM} if ROWS_TMA_FROM else set())


def rows_loads(num_experts: int, itemsize: int, lanes: int, tma: bool = False) -> tuple[int, int, int]:
    """``(TILE, AHEAD, ITERS)`` of a rows launch: the chunks a thread takes from each coalesced tile (0: none),
    the chunks it loads ahead, and its loop's iterations (:data:`ROWS_TILE`, :data:`ROWS_FP32_TILED_FROM`,
    :data:`ROWS_FP32_PAIR_TILE`, :data:`ROWS_AHEAD`, :data:`ROWS_AHEAD_FROM`; ``tma``: a launch whose tiles the
    tensor-memory accelerator copies, :data:`ROWS_TMA_TILE`)."""
    tile = ROWS_TMA_TILE if tma else ROWS_TILE
    if itemsize == 4:
        tile = 1 if num_experts >= ROWS_FP32_TILED_FROM else ROWS_FP32_PAIR_TILE if lanes <= 2 else ROWS_TILE
    chunks = -(-num_experts // 8)
    iters = -(-chunks // (lanes * max(tile, 1)))
    ahead = ROWS_AHEAD if itemsize < 4 and not tile and -(-chunks // lanes) >= ROWS_AHEAD_FROM else 1
    ahead = max(a for a in (1, 2, 4) if a <= ahead and iters % a == 0)  # whole steps of AHEAD chunks
    return tile, ahead, iters


def rows_index_bits(num_experts: int) -> int:
    """Bits of the rows algorithm's expert field: enough for ``8 * cdiv(num_experts, 8) - 1``, at least 3."""
    return max(3, (8 * -(-num_experts // 8) - 1).bit_length())

TILE_GROUPS = 16
"""Groups of a dynamic-tile launch (program ``p`` in group ``p % TILE_GROUPS``), each with its own
counter: one counter for all programs serialised the claims (one atomic on one address per
nanosecond or so: 72 us for 65536 one-token tiles, against 34 us of work)."""

DYNAMIC_TILES_FROM = 8
"""Fewest tiles per program (on average) for which a launch claims tiles dynamically. On an
H200 (4224 programs): at 16384 tokens (3.9 per program) the static loop was faster (10.6
against 11.4 us at E=256), at 32768 (7.8) the two were within 1% at E=256 and claiming lost
4% at E=128, from 49152 (11.6) claiming won (24.7 against 26.0 us; 31.1 against 34.0 at 65536).
The one-tile loop of 257-512 experts (3696 programs at 384 experts) claimed won at 32768 and
65536 tokens (384 experts: 22.3 against 23.6 us, 39.9 against 42.3; 512 experts at 65536:
51.8 against 55.9)."""

_TILE_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def tile_counters(device: torch.device, allocate: bool = True) -> torch.Tensor | None:
    """The atomic tile counters of dynamic-tile launches on ``device``'s current stream.

    ``[TILE_GROUPS * 32]`` int32 (one 128-byte line per group), zero between launches: every
    launch leaves them as it found them. Launches on one stream run one after another and
    share them; each stream has its own, so launches on different streams may overlap. A
    CUDA graph keeps the counters of the stream it was captured on, so two graphs captured
    on one stream must not be replayed at the same time on different streams (give one of
    them a config with ``dynamic_tiles=False``). Allocating a stream's counters also
    allocates those of the stream that ``torch.cuda.graph`` captures on by default, so a
    graph captured after an eager call finds them.

    Args:
        device: a CUDA device.
        allocate: allocate (zeroed) if the stream has none yet; ``False`` returns ``None``
            instead (while a CUDA graph is captured: an allocation would come from the
            graph's private pool, and the launch takes its tiles statically).
    """
    stream = torch.cuda.current_stream(device)
    key = (stream.device.index, stream.cuda_stream)
    if key not in _TILE_COUNTERS:
        if not allocate:
            return None
        _TILE_COUNTERS[key] = torch.zeros(TILE_GROUPS * 32, dtype=torch.int32, device=stream.device)
        if torch.cuda.graph.default_capture_stream is None:  # (as torch.cuda.graph creates it on first use)
            torch.cuda.graph.default_capture_stream = torch.cuda.Stream(device=stream.device)
        capture = torch.cuda.graph.default_capture_stream
        capture_key = (capture.device.index, capture.cuda_stream)
        if capture.device == stream.device and capture_key not in _TILE_COUNTERS:
            _TILE_COUNTERS[capture_key] = torch.zeros(TILE_GROUPS * 32, dtype=torch.int32, device=stream.device)
    return _TILE_COUNTERS[key]


PING_PONG_MAX_SLICES = 8
"""Most logit slices per thread for the two-level persistent loop's two register sets (256
experts in 32 columns): up to 256 experts the kernel needs 61 registers either way, while at
384 the second set takes it from 72 to 91 (``benchmarks/inspect_kernel.py``), so 28 programs
per SM no longer reside."""


def _next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (``n`` >= 1), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length()


def padded_num_experts(num_experts: int) -> int:
    """Next power of two >= ``num_experts``, at least 8 (the seed's padding)."""
    return 1 << max(3, (num_experts - 1).bit_length())


SMALL_BATCH = 2048
"""Up to this many tokens the launch favours latency (scan, one token per program, 32 lanes a row)."""

PERSISTENT_FROM = 4096
"""Above this many tokens the two-level launch is a persistent grid (below, one program per token)."""

TWO_LEVEL_MAX_TOPK = 32
"""Largest ``topk`` of the two-level default (its output slots are the 32 columns of a row)."""


def default_config(num_tokens: int, num_experts: int, gating_dtype: torch.dtype, device_type: str = "cuda",
                   topk: int = 8, normalization: str = "sigmoid") -> LaunchConfig:
    """Launch settings chosen by shape, from the sweeps in benchmarks/NOTES.md (H200).

    * small batches (<= :data:`SMALL_BATCH` tokens, decode): the scan algorithm, one token
      per program and one warp, 32 lanes per row (each holding ``16 / itemsize``-wide
      vectors), so every reduction of a selection round is a single warp-wide ``REDUX``
      on Hopper: the shortest dependency chain;
    * large batches (prefill) of sigmoid routers with ``topk`` <= :data:`ROWS_MAX_TOPK` and at most
      :data:`ROWS_MAX_EXPERTS` experts: the rows algorithm, 2 to 8 threads a token by batch size and dtype
      (:func:`rows_launches`;
      :func:`routetool_kernels.routing_jit._rows_kernel`);
    * other large batches: the two-level algorithm, one warp per token, 32 columns;
      above :data:`PERSISTENT_FROM` tokens on a persistent grid of 32 programs per SM (the
      most one-warp programs an SM holds; up to 256 experts the kernel needs at most 64
      registers, so all 32 reside), 28 for 257-384 experts (72 registers: 28 reside); it
      touches each expert a constant number of times instead of ``topk`` times; the
      persistent grid claims tiles dynamically (``dynamic_tiles``, where it applies). Scan
      with 8 tokens over 4 warps when ``topk`` > :data:`TWO_LEVEL_MAX_TOPK`.

    Under the Triton interpreter (CPU tensors) each program costs Python overhead, so
    programs take up to 128 rows of the scan algorithm instead.
    """
    e_pad = padded_num_experts(num_experts)
    vec = 16 // gating_dtype.itemsize
    if device_type != "cuda":
        return LaunchConfig(block_t=min(128, _next_power_of_2(max(1, num_tokens))), chunk=min(e_pad, 64),
                            num_warps=4)
    chunk = min(e_pad, 32 * vec)
    if num_tokens <= SMALL_BATCH:
        return LaunchConfig(block_t=1, chunk=chunk, num_warps=1)
    if normalization == "sigmoid" and topk <= ROWS_MAX_TOPK and num_experts <= ROWS_MAX_EXPERTS:
        lanes, warps = next((lanes, warps) for above, lanes, warps in rows_launches(num_experts, gating_dtype)
                            if num_tokens > above)
        return LaunchConfig(block_t=32 * warps // lanes, chunk=lanes, num_warps=warps, algorithm="rows")
    if topk <= TWO_LEVEL_MAX_TOPK:
        return two_level_config(num_tokens, num_experts, topk)
    return LaunchConfig(block_t=8, chunk=chunk, num_warps=4)


def two_level_config(num_tokens: int, num_experts: int, topk: int = 8) -> LaunchConfig:
    """The two-level launch :func:`default_config` picks for a large batch on a GPU (``topk`` <=
    :data:`TWO_LEVEL_MAX_TOPK`): one token per one-warp program, 32 columns (at least ``topk``), above
    :data:`PERSISTENT_FROM` tokens a persistent grid (28 programs per SM for 257-384 experts, else 32)
    claiming its tiles."""
    width = max(min(padded_num_experts(num_experts), 32), _next_power_of_2(topk))
    per_sm = 0 if num_tokens <= PERSISTENT_FROM else 28 if 256 < num_experts <= 384 else 32
    return LaunchConfig(block_t=1, chunk=width, num_warps=1, algorithm="two_level", programs_per_sm=per_sm,
                        dynamic_tiles=per_sm > 0)


def sum_bits(num_terms: int) -> int:
    """Fraction bits ``F`` of the kernels' order-independent sums of up to ``num_terms`` scores.

    The kernels sum the picked scores (``num_terms`` = ``topk``) and the softmax numerators
    (``num_terms`` = the padded expert count) in fixed point, so that every algorithm and tile
    gets the same bits (``routetool_kernels.routing_jit._fixed_point``): each term, scaled so the largest
    lies in ``[2**F, 2**(F + 1)]``, is split into ``round(x)`` and ``round((x - round(x)) * L)``
    (``L = 2**min(22, F + 8)``), and the two int32 sums are exact in any order. ``F = min(21,
    23 - ceil(log2 num_terms))`` keeps the first sum within ``2**24`` (exact in float32) and
    the second within int32; each term is exact to ``2**-(F + log2 L + 1)`` of the largest
    (``2**-43`` for 8 picks, ``2**-37`` for 512 softmax terms), the sum rounded once.
    """
    return min(21, 23 - (max(1, num_terms) - 1).bit_length())


MAX_TILE_ELEMENTS = 2**20
"""Triton's largest tensor: ``block_t`` times the padded expert count may not exceed it."""


def check_launch_config(config: LaunchConfig, num_experts: int, topk: int, softmax: bool = False) -> None:
    """Raise ``ValueError`` naming the field when ``config`` cannot run ``[*, num_experts]`` with ``topk``.

    Checked: every field an int (``algorithm`` one of :data:`ALGORITHMS`); ``block_t``,
    ``chunk`` and ``num_warps`` powers of two, ``num_warps`` <= 32 (1024 threads), ``chunk``
    <= the padded expert count, ``block_t`` * padded experts <= :data:`MAX_TILE_ELEMENTS`;
    for ``two_level`` ``topk`` <= ``chunk``; ``programs_per_sm`` >= 0; ``max_registers`` 0
    or in [24, 255]; ``dynamic_tiles`` a bool, true only for ``two_level`` with
    ``programs_per_sm`` > 0; for ``rows`` sigmoid scores (not ``softmax``), ``topk`` <=
    :data:`ROWS_MAX_TOPK`, at most :data:`ROWS_MAX_EXPERTS` experts, ``chunk`` <= 8 threads a token,
    ``block_t = 32 * num_warps / chunk`` and ``programs_per_sm`` 0.
    """
    if not isinstance(config, LaunchConfig):
        raise ValueError(f"config must be a kernel.LaunchConfig, got {type(config).__name__}")
    e_pad = padded_num_experts(num_experts)
    for name in ("block_t", "chunk", "num_warps", "programs_per_sm", "max_registers"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"launch config {name}={value!r} must be an int")
    for name in ("block_t", "chunk", "num_warps"):
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"launch config {name}={value} must be a power of two")
    if config.num_warps > 32:
        raise ValueError(f"launch config num_warps={config.num_warps} exceeds 32 (1024 threads per program)")
    if config.chunk > e_pad:
        raise ValueError(f"launch config chunk={config.chunk} exceeds the padded expert count {e_pad}")
    if config.block_t * e_pad > MAX_TILE_ELEMENTS:
        raise ValueError(f"launch config block_t={config.block_t} times {e_pad} padded experts exceeds Triton's "
                         f"largest tensor ({MAX_TILE_ELEMENTS} elements)")
    if config.algorithm not in ALGORITHMS:
        raise ValueError(f"launch config algorithm={config.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    if config.algorithm == "two_level" and topk > config.chunk:
        raise ValueError(f"the two_level algorithm needs topk <= chunk (columns), got topk={topk}, "
                         f"chunk={config.chunk}")
    if config.algorithm == "rows":
        if softmax or topk > ROWS_MAX_TOPK or num_experts > ROWS_MAX_EXPERTS:
            raise ValueError(f"the rows algorithm needs sigmoid scores, topk <= {ROWS_MAX_TOPK} and at most "
                             f"{ROWS_MAX_EXPERTS} experts, got {'softmax' if softmax else 'sigmoid'}, topk={topk}, "
                             f"{num_experts} experts")
        if config.chunk > 8 or config.block_t * config.chunk != 32 * config.num_warps or config.programs_per_sm:
            raise ValueError(f"the rows algorithm routes each token on chunk <= 8 threads: block_t must be 32 * "
                             f"num_warps / chunk ({32 * config.num_warps // config.chunk}) and programs_per_sm 0, "
                             f"got block_t={config.block_t}, chunk={config.chunk}, "
                             f"programs_per_sm={config.programs_per_sm}")
    if config.programs_per_sm < 0:
        raise ValueError(f"launch config programs_per_sm={config.programs_per_sm} must be >= 0")
    if config.max_registers and not 24 <= config.max_registers <= 255:
        raise ValueError(f"launch config max_registers={config.max_registers} must be 0 or in [24, 255]")
    if not isinstance(config.dynamic_tiles, bool):
        raise ValueError(f"launch config dynamic_tiles={config.dynamic_tiles!r} must be a bool")
    if config.dynamic_tiles and (config.algorithm != "two_level" or config.programs_per_sm == 0):
        raise ValueError("launch config dynamic_tiles=True needs algorithm='two_level' and programs_per_sm > 0 "
                         "(a persistent grid)")


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _fast_math(device: torch.device, interpreted: bool) -> bool:
    """Whether the kernels may use NVIDIA's approximate ``ex2``/``rcp``: compiled (not ``interpreted``) for NVIDIA."""
    return device.type == "cuda" and torch.version.hip is None and not interpreted

