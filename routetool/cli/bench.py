"""``routetool bench``: its options and its analysis step (check the options on any machine, time
the kernels on the GPU); the command base (routetool.cli.command) checks the paths, renders and
exits."""

from __future__ import annotations

from pathlib import Path

import click

from routetool.cli.command import Run, finite, force_option, json_option, output_option, progress_option, run_command
from routetool.cli.paths import PATH
from routetool.errors import RouteToolError
from routetool.numtext import list_items, parse_int, refuse_repeats
from routetool.report.sinks import CsvSink, JsonSink, Sinks


def _int_list(text: str, name: str) -> list[int]:
    values = [parse_int(v) for v in list_items(name, text, "1,64,4096")]
    if any(v is None for v in values):
        raise RouteToolError(f"{name} {text!r} is not a comma-separated list of integers", fix="e.g. 1,64,4096")
    if any(v < 1 for v in values):
        raise RouteToolError(f"{name} {text!r} needs positive integers", fix="e.g. 1,64,4096")
    return refuse_repeats(name, text, values)


@click.command()
@click.option("--tokens", default="1,8,64,256,1024,4096,16384,65536", show_default=True,
              help="Comma-separated num_tokens to sweep (each at most 16777216, 2^24).")
@click.option("--trace", "trace_path", type=PATH, default=None,
              help="Also sweep the step shapes of this trace (and use its num_experts/topk unless given).")
@click.option("--experts", default=None, help="Comma-separated num_experts [default: 128,256,384,512].")
@click.option("--topk", "topks", default=None, help="Comma-separated topk [default: 8].")
@click.option("--dtype", "dtypes", default="fp32,bf16", show_default=True, help="Gating dtypes: fp32, bf16, fp16.")
@click.option("--kernel", "kernels", multiple=True,
              help="Kernels (repeatable): tiled, seed, torch, torch-compile, module:function [default: tiled, seed, torch].")
@click.option("--baseline", default="seed", show_default=True, help="Kernel the speedup is relative to.")
@click.option("--pdl", type=click.Choice(["on", "off", "both"]), default="on", show_default=True,
              help="Programmatic dependent launch for the project's variants.")
@click.option("--graph/--no-graph", default=True, show_default=True, help="Time under CUDA-graph replay.")
@click.option("--rep-ms", type=click.FloatRange(min=1, max=60_000), default=20.0, show_default=True, callback=finite,
              help="Timing budget per point and kernel, in milliseconds (1-60000).")
@output_option("--csv", "csv_path", "Write the long-format CSV ('-' = stdout).")
@json_option("Write the results as JSON ('-' = stdout).")
@force_option("Replace existing output files.")
@progress_option()
def bench(tokens: str, trace_path: Path | None, experts: str | None, topks: str | None, dtypes: str,
          kernels: tuple[str, ...], baseline: str, pdl: str, graph: bool, rep_ms: float, csv_path: str | None,
          json_path: str | None, force: bool, progress: bool) -> None:
    """Time routing kernels over a sweep of shapes on a CUDA GPU.

    Each kernel's first call on a point is judged by the one kernel contract and validate's checks
    before timing: a kernel that fails is reported, not timed (exit 1); a documented rejection (the
    seed and bf16) is reported as rejected. Reports p10/p50/p90 latency (µs) under CUDA graphs,
    the host cost per eager call against an empty Triton launch, achieved bandwidth and its
    fraction of the measured copy bandwidth, and the speedup over --baseline.
    """

    def analyse(run: Run):
        import torch

        from routetool.analysis.bench import (
            DTYPES,
            MAX_TOKENS,
            check_fits,
            resolve_kernels,
            run_bench,
            trace_step_shapes,
        )
        from routetool.engine.execution import select_execution
        from routetool.report.bench import BenchReport

        token_list = _int_list(tokens, "--tokens")
        if max(token_list) > MAX_TOKENS:
            raise RouteToolError(f"--tokens {tokens!r}: {max(token_list)} tokens per point is above bench's limit of "
                                 f"{MAX_TOKENS} (2^24)",
                                 fix="choose at most 16777216 tokens; 2^24 tokens of fp32 logits at 512 experts "
                                     "are 32 GiB")
        expert_list = _int_list(experts, "--experts") if experts else None
        topk_list = _int_list(topks, "--topk") if topks else None
        if trace_path is not None:
            shapes, router = trace_step_shapes(trace_path)
            token_list = sorted(set(token_list) | set(shapes))
            expert_list = expert_list or [router.num_experts]
            topk_list = topk_list or [router.topk]
        expert_list = expert_list or [128, 256, 384, 512]
        topk_list = topk_list or [8]
        dtype_list = list_items("--dtype", dtypes, "fp32,bf16")  # "fp32,,bf16" ran as fp32,bf16
        unknown = [d for d in dtype_list if d not in DTYPES]
        if unknown:
            raise RouteToolError(f"--dtype {dtypes!r}", fix=f"use a comma-separated subset of {', '.join(DTYPES)}")
        refuse_repeats("--dtype", dtypes, dtype_list)
        points = sum(1 for e in expert_list for k in topk_list if k <= e)
        if not points:
            raise RouteToolError(f"every --topk ({', '.join(map(str, topk_list))}) exceeds every expert count "
                                 f"({', '.join(map(str, expert_list))}): nothing to time",
                                 fix="choose topk <= num_experts")
        # kernels resolved (names checked, modules imported) before the GPU check, so that a
        # mistake in the options shows on any machine
        has_cuda = torch.cuda.is_available()
        select_execution("cuda" if has_cuda else "cpu")
        repeated = next((k for i, k in enumerate(kernels) if k in kernels[:i]), None)
        if repeated is not None:  # it would be timed twice
            raise RouteToolError(f"--kernel {repeated} is given twice", fix="give each kernel once")
        specs = list(kernels) or ["tiled", "seed", "torch"]
        bench_kernels = resolve_kernels(specs, pdl)
        explicit = (click.get_current_context().get_parameter_source("baseline")
                    != click.core.ParameterSource.DEFAULT)
        if explicit and baseline not in {k.name for k in bench_kernels}:
            raise RouteToolError(f"--baseline {baseline!r} is not among the timed kernels ({', '.join(specs)})",
                                 fix="name one of the --kernel values, or add it with --kernel")
        if not has_cuda:
            raise RouteToolError("bench needs a CUDA GPU; this machine has none",
                                 fix="run it on a GPU machine; replay and validate work on the CPU")
        check_fits(token_list, expert_list, topk_list, dtype_list, torch.cuda.mem_get_info()[0],
                   f"the GPU ({torch.cuda.get_device_name()})")
        total = len(bench_kernels) * len(token_list) * len(dtype_list) * points
        with run.progress() as bar:
            task = bar.add_task("bench", total=total)
            result = run_bench(bench_kernels, token_list, expert_list, topk_list, dtype_list, baseline=baseline,
                               use_graph=graph, rep_ms=rep_ms, progress=lambda _: bar.advance(task))
        return BenchReport(result)

    run_command(analyse, sinks=Sinks(CsvSink(csv_path), JsonSink(json_path)), reads=[trace_path], kernels=kernels,
                force=force, progress=progress)
