"""``routetool diff A B``: check the paths, open both sources, diff them, render, exit as Unix diff."""

from __future__ import annotations

from pathlib import Path

import click

from routetool.cli.command import (
    Run, details_option, finite, force_option, json_option, kernel_option, output_option, progress_option,
    run_command,
)
from routetool.cli.paths import PATH
from routetool.engine.execution import DEVICE_CHOICES
from routetool.report.sinks import FigureSink, JsonSink, Sinks
from routetool.report.tables import markup_safe


@click.command()
@click.argument("source_a", metavar="A", type=PATH)
@click.argument("source_b", metavar="B", type=PATH)
@click.option("--layers", "layers_spec", default="all", show_default=True,
              help="Layers to compare, e.g. 0,2,5-7 (all: both sources must hold the same layers).")
@click.option("--align", type=click.Choice(["auto", "requests", "steps", "rows"]), default="auto", show_default=True,
              help="requests: by request and token position (engine outputs that record them, in any order); "
                   "steps: the same tokens in every step; rows: the same tokens in every layer, steps ignored; "
                   "auto: requests where both sources name them, else steps.")
@kernel_option("How a source holding logits only is routed: the reference, a kernel variant (tiled, seed) or "
               "module:function (refused when neither source holds logits alone).", default="reference")
@click.option("--pair-layers", is_flag=True,
              help="Compare A's i-th layer with B's i-th, whatever their numbers (an engine's hidden-layer numbers "
                   "against a trainer's MoE-layer numbers); --layers then names A's.")
@click.option("--kernel-b", "kernel_b_spec", default=None,
              help="Route B's logits by this kernel instead (reference, tiled, seed or module:function; default: "
                   "--kernel): the reference against a kernel, or a kernel before and after a change, on one trace.")
@click.option("--topk", type=click.IntRange(min=1), default=None,
              help="Experts per token of an engine output that does not record it (SGLang's routed experts); "
                   "default: the other source's.")
@click.option("--device", type=click.Choice(DEVICE_CHOICES), default="cpu", show_default=True,
              help="Where the rows are routed and compared.")
@click.option("--tie-ulps", type=click.FloatRange(min=0, max=1e6), default=16.0, show_default=True, callback=finite,
              help="Near-tie tolerance at the k-th pick, in float32 ulps (0 = exact ties only).")
@click.option("--weight-ulps", type=click.FloatRange(min=0, max=1e12), default=0.0, show_default=True, callback=finite,
              help="Weights this many float32 ulps apart count as equal (0 = the same bits).")
@click.option("--ignore-ties", is_flag=True, help="Differences inside near-ties do not make exit 1.")
@click.option("--ignore-order", is_flag=True, help="Slot-order flips (the same experts in other slots) do not make exit 1.")
@click.option("--max-flip-rate", type=click.FloatRange(min=0, max=1), default=None, callback=finite,
              help="Exit 0 while the share of differing token-layers (after --ignore-*) is at most this fraction "
                   "(0.01 = 1%; 1 tolerates every difference).")
@json_option("Also write the results as JSON to PATH ('-' = stdout; the report then goes to stderr).")
@output_option("--plot", "plot_path", "Write a PNG of agreement by layer to PATH (needs matplotlib).")
@details_option("Every layer's measures and the first differing rows.")
@force_option("Replace an existing --json, --plot or --html file.")
@progress_option()
def diff(source_a: Path, source_b: Path, layers_spec: str, align: str, pair_layers: bool, kernel_spec: str,
         kernel_b_spec: str | None, topk: int | None,
         device: str, tie_ulps: float, weight_ulps: float, ignore_ties: bool, ignore_order: bool,
         max_flip_rate: float | None, json_path: str | None, plot_path: str | None, details: bool, force: bool, progress: bool) -> None:
    """Where and why two routings of the same tokens differ.

    A and B: traces, sharded traces, run folders, ids-only traces or the engines' routing
    outputs (vLLM, SGLang, Megatron, FlashInfer-Trace). A source's recorded topk_ids/weights are
    compared where it holds them; logits alone are routed with its own router spec. Exit 0
    identical (or within --ignore-ties, --ignore-order, --max-flip-rate), 1 different, 2 trouble.
    """

    def analyse(run: Run):
        from routetool.analysis.diff import diff_sources, open_sources
        from routetool.analysis.replay import parse_layers
        from routetool.engine.execution import load_kernel, select_execution
        from routetool.report.diff import DiffReport

        execution = select_execution(device)
        kernel = None if kernel_spec == "reference" else load_kernel(kernel_spec)
        kernel_b = None if kernel_b_spec is None else (("reference", None) if kernel_b_spec == "reference"
                                                       else load_kernel(kernel_b_spec))
        a, b = open_sources(source_a, source_b, topk=topk)
        try:
            held = sorted({layer for s in ((a,) if pair_layers else (a, b)) for _, layer in s.units})
            layers = None if layers_spec == "all" else parse_layers(layers_spec, held, f"{source_a} and {source_b}")
            with run.progress() as bar:
                task = bar.add_task(markup_safe(f"diff {source_a.name} {source_b.name}"), total=None)
                result = diff_sources(a, b, layers=layers, align=align, tie_ulps=tie_ulps, weight_ulps=weight_ulps,
                                      ignore_ties=ignore_ties, ignore_order=ignore_order,
                                      max_flip_rate=max_flip_rate, device=execution.device, kernel=kernel,
                                      kernel_b=kernel_b, pair_layers=pair_layers,
                                      progress=lambda n: bar.advance(task, n))
        finally:
            b.close()
            a.close()
        return DiffReport(result)

    run_command(analyse, sinks=Sinks(JsonSink(json_path), FigureSink(plot_path)), inputs=[source_a, source_b],
                input_what="file or folder",
                kernels=[k for k in (kernel_spec, kernel_b_spec) if k not in (None, "reference")],
                force=force, progress=progress, details=details)
