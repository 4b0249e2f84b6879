"""``routetool bench``: latency and bandwidth of routing kernels over a sweep of shapes (GPU only).

For every point (num_tokens, num_experts, topk, gating dtype) and kernel: inputs are built
outside the timed region (rotating over enough input sets to exceed the L2 cache when one
set fits in it), the output is checked with validate's invariants and the tie-aware
comparison first (a kernel that fails is reported, not timed), then the call is timed under
CUDA-graph replay (``triton.testing.do_bench_cudagraph``), or with plain launches
(``triton.testing.do_bench``) when graphs are off. Bandwidth counts the bytes a routing call
must move: logits read once, bias read once, ids and weights written once.

Beside the GPU latency, every timed kernel's *host cost per call* (:func:`host_latencies`): the
host's time for back-to-back eager calls (no CUDA graph; the project's kernels and user kernels
write into caller-provided output buffers, the torch reference allocates its own) over the
same rotating inputs, with one synchronisation after each batch of calls, outside the timed
region. An engine pays it wherever it runs the router eagerly (prefill and chunked prefill
under piecewise CUDA graphs, the replay of a trace). The floor beside it is an empty Triton
kernel launched the ordinary way (``kernel[(1,)](buffer)``), its batches timed in turn with
the kernel's, so that both see the same state of the machine (on the H200 machine an empty
launch took 12 us at one moment and 18 us at another of the same run).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from routetool.errors import RouteToolError, first_line
from routetool.engine.execution import RoutingFn
from routetool.analysis.suite import CaseInput
from routetool.engine.timing import Latency, cuda_graph_latency

TORCH_KERNELS = ("torch", "torch-compile")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAX_TOKENS = 2**24
"""Most tokens of one bench point (16,777,216): 2^24 tokens of fp32 logits at 512 experts are
already 32 GiB, and engines route far fewer tokens per call."""
HOST_CALLS = 100
"""Back-to-back eager calls per host-cost sample: few enough that the GPU's launch queue (about a
thousand launches) never fills, so the host is never made to wait for the GPU inside a sample."""
HOST_SAMPLES = 20
"""Host-cost samples per kernel and point (p10/p50/p90 over them)."""
HOST_WARMUP_CALLS = 20
"""Calls of each function before its host-cost samples (compilation, first-call checks)."""


@dataclass(frozen=True)
class BenchKernel:
    """A kernel to time: ``pdl`` is None when the kernel has no PDL switch."""

    name: str
    fn: RoutingFn
    pdl: bool | None = None

    @property
    def label(self) -> str:
        return self.name if self.pdl is None else f"{self.name} (pdl {'on' if self.pdl else 'off'})"


@dataclass
class BenchRow:
    """One (point, kernel) measurement, in long format."""

    kernel: str
    pdl: bool | None
    num_tokens: int
    num_experts: int
    topk: int
    dtype: str
    cuda_graph: bool
    status: str  # "ok", "failed: <classes>: ...", "rejected (rejected_documented): ..." (judge_kernel_call)
    latency: Latency | None = None
    host: Latency | None = None  # host cost per eager call (:func:`host_latencies`)
    empty_launch: Latency | None = None  # the empty Triton launch's, timed in turn with ``host``: its floor
    bytes_moved: int = 0
    bandwidth_gbps: float | None = None
    bandwidth_fraction: float | None = None
    speedup: float | None = None


@dataclass
class BenchResult:
    """A whole sweep plus the machine it ran on."""

    gpu_name: str
    driver_version: str
    torch_version: str
    triton_version: str
    copy_bandwidth_gbps: float
    baseline: str | None
    rows: list[BenchRow] = field(default_factory=list)


def driver_version() -> str:
    """The NVIDIA driver version from nvidia-smi, or ``"unknown"``."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "unknown"
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def copy_bandwidth_gbps(num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    import triton.testing

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def resolve_kernels(specs: Sequence[str], pdl: str) -> list[BenchKernel]:
    """Kernels by name: variants (``tiled``, ``seed``), ``torch`` (the reference, eager),
    ``torch-compile`` (the reference under ``torch.compile``), or ``module:function``.
    Project variants are timed with PDL on and/or off as ``pdl`` (on|off|both) says.

    Raises:
        RouteToolError: an unknown kernel or an impossible ``--pdl``.
    """
    import routetool_kernels
    from routetool_kernels.reference import musespark1x_routing_reference
    from routetool.engine.execution import load_kernel

    if pdl not in ("on", "off", "both"):
        raise RouteToolError(f"--pdl {pdl!r}", fix="use on, off or both")
    out = []
    for spec in specs:
        if spec == "torch":
            out.append(BenchKernel("torch", musespark1x_routing_reference))
        elif spec == "torch-compile":
            out.append(BenchKernel("torch-compile", torch.compile(musespark1x_routing_reference, dynamic=False)))
        elif spec in routetool_kernels.VARIANT_NAMES:
            fn = routetool_kernels.variant(spec)
            for flag in ((True, False) if pdl == "both" else (pdl == "on",)):
                out.append(BenchKernel(spec, fn, flag))
        else:
            name, fn = load_kernel(spec, also=TORCH_KERNELS)
            out.append(BenchKernel(name, fn))
    return out


def point_bytes(num_tokens: int, num_experts: int, topk: int, dtype: torch.dtype) -> int:
    """Bytes a routing call must move, and the size of one set of its inputs and outputs:
    logits ``[T, E]`` (``dtype``), bias ``[E]`` float32, ids and weights ``[T, K]`` 4 bytes each."""
    return num_tokens * num_experts * dtype.itemsize + num_experts * 4 + num_tokens * topk * (4 + 4)


def check_fits(tokens: Sequence[int], experts: Sequence[int], topks: Sequence[int], dtypes: Sequence[str],
               free_bytes: int, gpu_name: str = "the GPU") -> None:
    """Refuse a sweep whose largest point's inputs and outputs do not fit in ``free_bytes``
    (the GPU memory free before the sweep), before any work.

    Raises:
        RouteToolError: naming the point, the bytes it needs and the bytes free.
    """
    need, T, E, K, dname = max((point_bytes(T, E, K, DTYPES[d]), T, E, K, d)
                               for d in dtypes for E in experts for K in topks if K <= E for T in tokens)
    if need > free_bytes:
        raise RouteToolError(f"{T:,} tokens x {E:,} experts ({dname}, topk {K}) need {need / 2**30:,.1f} GiB of "
                             f"inputs and outputs; {gpu_name} has {free_bytes / 2**30:,.1f} GiB free",
                             fix="lower --tokens or --experts, or free GPU memory")


def input_sets(T: int, E: int, K: int, dtype: torch.dtype, l2_bytes: int, seed: int) -> list[CaseInput]:
    """The inputs of one point on the GPU: ``[T, E]`` logits of ``dtype`` (standard normal times 2), in as many
    sets (at most 16) as exceed twice ``l2_bytes`` when one set fits in it, sharing one float32 ``[E]`` bias;
    each set with its own float32 / int32 ``[T, K]`` output buffers; ``route_scale`` 2.5."""
    one = T * E * dtype.itemsize
    n = max(1, min(16, -(-2 * l2_bytes // max(one, 1)))) if one < 2 * l2_bytes else 1
    g = torch.Generator(device="cuda").manual_seed(seed)
    bias = torch.randn(E, device="cuda", generator=g) * 0.05
    sets = []
    for _ in range(n):
        logits = (torch.randn((T, E), device="cuda", generator=g) * 2).to(dtype)
        sets.append(CaseInput.of(logits, bias, K, topk_weights=torch.empty((T, K), device="cuda"),
                                 topk_ids=torch.empty((T, K), dtype=torch.int32, device="cuda")))
    return sets


def judge_kernel_call(fn: RoutingFn, inp: CaseInput, *, tie_ulps: float, buffers: bool = True,
                      extra: dict | None = None) -> tuple[str, int]:
    """One call of ``fn`` on ``inp``, judged before it is timed: the one kernel contract
    (:meth:`routetool.engine.router.Router.call`), then validate's checks of the output.

    Args:
        fn: the kernel. inp: the point's first input set. tie_ulps: as validate's.
        buffers: pass ``inp``'s output buffers (False: the torch reference, which takes none).
        extra: more keyword arguments (``use_pdl``).

    Returns:
        ``(status, exit_code)``: ``("ok", 0)``; ``("rejected (rejected_documented): ...", 0)`` for a
        rejection the kernel documents (bench chose the input, as validate's suite does);
        ``("failed: CLASS: ...", 1)`` for a broken contract or failed checks.
    """
    from routetool.analysis.validate import evaluate
    from routetool.engine.router import Router

    call = fn if buffers else (lambda g, b, topk_weights=None, topk_ids=None, **k: fn(g, b, **k))
    out = Router(inp.router, call).call(inp.gating_output, inp.bias, is_padding=inp.is_padding,
                                        topk_weights=inp.topk_weights if buffers else None,
                                        topk_ids=inp.topk_ids if buffers else None, extra=extra)
    if not out.ok:
        detail = out.message("the kernel")
        if out.failure_class == "rejected_documented":
            return f"rejected ({out.failure_class}): {detail}", 0
        return f"failed: {out.failure_class}: {detail}", 1
    classes, _, _ = evaluate(inp, out.weights, out.ids, tie_ulps=tie_ulps)
    if classes:
        return "failed: " + ", ".join(classes), 1
    return "ok", 0


def _call_args(bk: BenchKernel, inp: CaseInput) -> tuple[tuple, dict]:
    """``bk.fn``'s arguments for ``inp``, by the documented convention: the logits and the bias by
    position, every other parameter by keyword; the torch reference allocates its own outputs."""
    kwargs = inp.kwargs()
    if bk.name not in TORCH_KERNELS:
        kwargs.update(topk_weights=inp.topk_weights, topk_ids=inp.topk_ids)
        if bk.pdl is not None:
            kwargs["use_pdl"] = bk.pdl
    return (inp.gating_output, inp.bias), kwargs


def rotating_call(bk: BenchKernel, sets: list[CaseInput]) -> Callable[[], object]:
    """A closure making one call of ``bk`` per invocation (:func:`_call_args`), each on the next of ``sets``
    (inputs and output buffers built beforehand; a set without buffers lets the call allocate its outputs)."""
    state = {"i": 0}
    calls = [_call_args(bk, inp) for inp in sets]

    def call():
        args, kwargs = calls[state["i"] % len(calls)]
        state["i"] += 1
        bk.fn(*args, **kwargs)

    return call


def _time(bk: BenchKernel, sets: list[CaseInput], use_graph: bool, rep_ms: float) -> Latency:
    import triton.testing

    call = rotating_call(bk, sets)
    if use_graph:
        return cuda_graph_latency(call, rep_ms=rep_ms)
    q = triton.testing.do_bench(call, rep=rep_ms, quantiles=[0.1, 0.5, 0.9])
    return Latency(p10_us=q[0] * 1e3, p50_us=q[1] * 1e3, p90_us=q[2] * 1e3)


def host_latencies(fns: Sequence[Callable[[], object]], calls: int = HOST_CALLS, samples: int = HOST_SAMPLES,
                   warmup_calls: int = HOST_WARMUP_CALLS) -> list[Latency]:
    """The host's time per call of each of ``fns``, in microseconds: eager, back-to-back calls.

    Each sample is the wall time of ``calls`` back-to-back calls of one function divided by
    ``calls``, read before the synchronisation that follows the batch (so the GPU's work is not
    in it, as long as the launch queue does not fill: :data:`HOST_CALLS`). The functions take
    their batches in turn, ``samples`` each, so that all of them see the same state of the
    machine; p10/p50/p90 are over a function's samples. ``warmup_calls`` calls of each come
    first (compilation, first-call checks).
    """
    for fn in fns:
        for _ in range(warmup_calls):
            fn()
    torch.cuda.synchronize()
    per_call: list[list[float]] = [[] for _ in fns]
    for _ in range(samples):
        for fn, out in zip(fns, per_call):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
    levels = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    out = []
    for values in per_call:
        q = torch.tensor(values, dtype=torch.float64).quantile(levels)
        out.append(Latency(p10_us=float(q[0]), p50_us=float(q[1]), p90_us=float(q[2])))
    return out


def host_latency(fn: Callable[[], object], **kw) -> Latency:
    """:func:`host_latencies` of one function."""
    return host_latencies([fn], **kw)[0]


_EMPTY_KERNEL = []


def empty_kernel():
    """A ``@triton.jit`` kernel that does nothing, of one pointer argument; defined on first use
    (Triton is imported only once the device is chosen)."""
    import triton

    if not _EMPTY_KERNEL:
        @triton.jit
        def _empty_kernel(x_ptr):  # (1,) int32, not read
            pass

        _EMPTY_KERNEL.append(_empty_kernel)
    return _EMPTY_KERNEL[0]


def empty_launch_call() -> Callable[[], object]:
    """A closure launching :func:`empty_kernel` on one program through Triton's ordinary dispatch,
    ``kernel[(1,)](buffer)``: the floor of a Triton kernel's host cost per call."""
    empty = empty_kernel()
    buf = torch.zeros(1, dtype=torch.int32, device="cuda")
    return lambda: empty[(1,)](buf)


def run_bench(
    kernels: Sequence[BenchKernel],
    tokens: Sequence[int],
    experts: Sequence[int],
    topks: Sequence[int],
    dtypes: Sequence[str],
    *,
    baseline: str | None = None,
    use_graph: bool = True,
    rep_ms: float = 20.0,
    tie_ulps: float = 16.0,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Time every kernel at every point, on the GPU and on the host (see the module docstring).

    Raises:
        RouteToolError: no CUDA GPU.
    """
    import triton

    if not torch.cuda.is_available():
        raise RouteToolError("bench needs a CUDA GPU; this machine has none",
                             fix="run it on a GPU machine; replay and validate work on the CPU")
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    result = BenchResult(gpu_name=props.name, driver_version=driver_version(), torch_version=torch.__version__,
                         triton_version=triton.__version__, copy_bandwidth_gbps=copy_bandwidth_gbps(), baseline=baseline)
    floor = empty_launch_call()
    for dname in dtypes:
        dtype = DTYPES[dname]
        for E in experts:
            for K in topks:
                if K > E:
                    continue
                for T in tokens:
                    sets = input_sets(T, E, K, dtype, l2, seed=T * 7919 + E * 31 + K)
                    bytes_moved = point_bytes(T, E, K, dtype)
                    point_rows = []
                    for bk in kernels:
                        row = BenchRow(kernel=bk.name, pdl=bk.pdl, num_tokens=T, num_experts=E, topk=K, dtype=dname,
                                       cuda_graph=use_graph, status="ok", bytes_moved=bytes_moved)
                        row.status, _ = judge_kernel_call(
                            bk.fn, sets[0], tie_ulps=tie_ulps, buffers=bk.name not in TORCH_KERNELS,
                            extra=None if bk.pdl is None else {"use_pdl": bk.pdl})
                        if row.status == "ok":
                            try:
                                row.latency = _time(bk, sets, use_graph, rep_ms)
                                row.host, row.empty_launch = host_latencies([rotating_call(bk, sets), floor])
                                row.bandwidth_gbps = bytes_moved / (row.latency.p50_us * 1e-6) / 1e9
                                row.bandwidth_fraction = row.bandwidth_gbps / result.copy_bandwidth_gbps
                            except Exception as exc:  # noqa: BLE001 - a kernel that passed once but cannot be timed
                                row.status = f"failed: crash: while timing: {first_line(exc, 170)}"
                        point_rows.append(row)
                        if progress is not None:
                            progress(f"{bk.label} T={T} E={E} k={K} {dname}")
                    base = next((r for r in point_rows if r.kernel == baseline and r.latency is not None
                                 and r.pdl in (None, True)), None)
                    for r in point_rows:
                        if base is not None and r.latency is not None:
                            r.speedup = base.latency.p50_us / r.latency.p50_us
                    result.rows.extend(point_rows)
                    del sets
    return result


def trace_step_shapes(path):
    """Distinct step sizes (tokens per forward step) of a trace's layers with gating logits,
    ascending, and its router config.

    Raises:
        RouteToolError: the trace cannot be read, or no layer holds gating_output (an ids-only
            trace, e.g. from ``routetool import``: its shapes and router settings are not those
            of a captured router call).
    """
    from routetool.io.trace import open_trace

    with open_trace(path) as t:
        layers = [x for x in t.layers if t.info(x).has_logits]
        if not layers:
            raise RouteToolError("holds no gating_output in any layer (an ids-only trace): bench takes step shapes "
                                 "from traces with logits", path=t.display_path,
                                 fix="give a trace with logits, or the shapes with --tokens/--experts/--topk")
        sizes = {b - a for layer in layers for a, b in zip(t.info(layer).step_offsets, t.info(layer).step_offsets[1:])}
        return sorted(sizes), t.meta.router
