"""The bench report: GPU latency, bandwidth and host cost per point; its JSON and long-format CSV."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.panel import Panel

from routetool.report.tables import Console, table, user_text

if TYPE_CHECKING:  # the types of the results rendered here; importing them would import torch
    pass


# ---------------------------------------------------------------------------------------
# bench
BENCH_SCHEMA = "routetool.bench/1"


BENCH_FIELDS = ("gpu_name", "driver_version", "torch_version", "triton_version", "kernel", "pdl", "num_tokens",
                "num_experts", "topk", "dtype", "cuda_graph", "status", "latency_us_p10", "latency_us_p50",
                "latency_us_p90", "bytes_moved", "bandwidth_gbps", "bandwidth_fraction_of_copy", "speedup_vs_baseline",
                "host_us_p10", "host_us_p50", "host_us_p90", "empty_launch_host_us_p50", "host_over_empty_launch")


def bench_records(result) -> list[dict]:
    """One flat record per (point, kernel): the long format of the CSV and JSON outputs. ``host_us_*``: the
    host cost per eager call; ``empty_launch_host_us_p50``: an empty Triton launch's, the floor, timed in turn
    with it; ``host_over_empty_launch``: their ratio (p50s)."""
    out = []
    for r in result.rows:
        out.append({
            "gpu_name": result.gpu_name, "driver_version": result.driver_version,
            "torch_version": result.torch_version, "triton_version": result.triton_version,
            "kernel": r.kernel, "pdl": r.pdl, "num_tokens": r.num_tokens, "num_experts": r.num_experts,
            "topk": r.topk, "dtype": r.dtype, "cuda_graph": r.cuda_graph, "status": r.status,
            "latency_us_p10": r.latency.p10_us if r.latency else None,
            "latency_us_p50": r.latency.p50_us if r.latency else None,
            "latency_us_p90": r.latency.p90_us if r.latency else None,
            "bytes_moved": r.bytes_moved, "bandwidth_gbps": r.bandwidth_gbps,
            "bandwidth_fraction_of_copy": r.bandwidth_fraction, "speedup_vs_baseline": r.speedup,
            "host_us_p10": r.host.p10_us if r.host else None,
            "host_us_p50": r.host.p50_us if r.host else None,
            "host_us_p90": r.host.p90_us if r.host else None,
            "empty_launch_host_us_p50": r.empty_launch.p50_us if r.empty_launch else None,
            "host_over_empty_launch": r.host.p50_us / r.empty_launch.p50_us if r.host and r.empty_launch else None,
        })
    return out


def bench_json(result) -> dict:
    return {"schema": BENCH_SCHEMA, "gpu_name": result.gpu_name, "driver_version": result.driver_version,
            "torch_version": result.torch_version, "triton_version": result.triton_version,
            "copy_bandwidth_gbps": result.copy_bandwidth_gbps, "baseline": result.baseline,
            "rows": bench_records(result)}


def bench_csv(result) -> str:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(BENCH_FIELDS))
    writer.writeheader()
    for rec in bench_records(result):
        writer.writerow({k: ("" if v is None else v) for k, v in rec.items()})
    return buf.getvalue()


def render_bench(result, console: Console) -> None:
    """Print the sweep as a table: GPU latency (p50 with p10/p90), bandwidth, speedup, and the host
    cost per eager call (p50) with its ratio to the empty Triton launch timed in turn with it."""
    floors = [r.empty_launch.p50_us for r in result.rows if r.empty_launch]
    console.print(Panel(f"{result.gpu_name}, driver {result.driver_version}, torch {result.torch_version}, "
                        f"triton {result.triton_version}; copy bandwidth {result.copy_bandwidth_gbps:,.0f} GB/s "
                        "(read + write)" + (f"; an empty Triton launch took {min(floors):.1f}-{max(floors):.1f} µs of "
                                            "host time per call, timed in turn with each row" if floors else ""),
                        title="routetool bench", expand=False))
    mode = "CUDA graph" if any(r.cuda_graph for r in result.rows) else "no graph"
    t = table(user_text(f"GPU latency (µs, {mode}) and bandwidth; speedup vs {result.baseline or '-'}; host µs per "
                        "eager call (x the empty launch)"),
              ["kernel", "tokens", "E", "k", "dtype", "p50", "p10-p90", "GB/s", "of copy", "speedup", "host",
               "x launch", "status"],
              left=("kernel", "dtype", "status"))
    for r in result.rows:
        label = r.kernel if r.pdl is None else f"{r.kernel} pdl {'on' if r.pdl else 'off'}"
        lat = r.latency
        t.add_row(user_text(label), f"{r.num_tokens:,}", str(r.num_experts), str(r.topk), r.dtype,
                  f"{lat.p50_us:.2f}" if lat else "-", f"{lat.p10_us:.2f}-{lat.p90_us:.2f}" if lat else "-",
                  f"{r.bandwidth_gbps:,.0f}" if r.bandwidth_gbps else "-",
                  f"{r.bandwidth_fraction:.0%}" if r.bandwidth_fraction else "-",
                  f"{r.speedup:.2f}x" if r.speedup else "-",
                  f"{r.host.p50_us:.1f}" if r.host else "-",
                  f"{r.host.p50_us / r.empty_launch.p50_us:.2f}x" if r.host and r.empty_launch else "-",
                  user_text(r.status, style="green" if r.status == "ok" else "bold red"))
    console.print(t)




class BenchReport:
    """bench's report (:class:`routetool.report.protocol.Report`), with its long-format CSV face;
    exit code 1 when a kernel failed on a point."""

    def __init__(self, result) -> None:
        self.result = result

    @property
    def exit_code(self) -> int:
        from routetool.errors import EXIT_FINDINGS, EXIT_OK

        return EXIT_FINDINGS if any(r.status.startswith("failed") for r in self.result.rows) else EXIT_OK

    def terminal(self, console: Console, details: bool = False) -> None:
        render_bench(self.result, console)

    def document(self) -> dict:
        return bench_json(self.result)

    def csv(self) -> str:
        return bench_csv(self.result)
