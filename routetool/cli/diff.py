"""``routetool diff A B``: check the paths, open both sources, diff them, render, exit as Unix diff."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from routetool.cli.common import KERNEL_SIGNATURE_HELP, _finite, _progress
from routetool.cli.numbers import FloatRange
from routetool.cli.paths import PATH, PATH_TEXT
from routetool.engine.execution import DEVICE_CHOICES, kernel_source, kernel_stdout
from routetool.report.tables import Console, markup_safe


@click.command()
@click.argument("source_a", metavar="A", type=PATH)
@click.argument("source_b", metavar="B", type=PATH)
@click.option("--layers", "layers_spec", default="all", show_default=True,
              help="Layers to compare, e.g. 0,2,5-7 (all: both sources must hold the same layers).")
@click.option("--align", type=click.Choice(["steps", "rows"]), default="steps", show_default=True,
              help="steps: the same tokens in every step; rows: the same tokens in every layer, steps ignored.")
@click.option("--kernel", "kernel_spec", default="reference", show_default=True,
              help="How a source holding logits only is routed: the reference, a kernel variant (tiled, seed) or "
                   "module:function. " + KERNEL_SIGNATURE_HELP)
@click.option("--device", type=click.Choice(DEVICE_CHOICES), default="cpu", show_default=True,
              help="Where the rows are routed and compared.")
@click.option("--tie-ulps", type=FloatRange(min=0, max=1e6), default=16.0, show_default=True, callback=_finite,
              help="Near-tie tolerance at the k-th pick, in float32 ulps (0 = exact ties only).")
@click.option("--weight-ulps", type=FloatRange(min=0, max=1e12), default=0.0, show_default=True, callback=_finite,
              help="Weights this many float32 ulps apart count as equal (0 = the same bits).")
@click.option("--ignore-ties", is_flag=True, help="Differences inside near-ties do not make exit 1.")
@click.option("--ignore-order", is_flag=True, help="Slot-order flips (the same experts in other slots) do not make exit 1.")
@click.option("--max-flip-rate", type=FloatRange(min=0), default=None, callback=_finite,
              help="Exit 0 while the share of differing token-layers (after --ignore-*) is at most this fraction "
                   "(0.01 = 1%; 1 tolerates every difference).")
@click.option("--json", "json_path", type=PATH_TEXT, default=None, metavar="PATH",
              help="Also write the results as JSON to PATH ('-' = stdout; the report then goes to stderr).")
@click.option("--plot", "plot_path", type=PATH_TEXT, default=None, metavar="PNG",
              help="Write a PNG of agreement by layer (needs matplotlib).")
@click.option("--details", "-v", "details", is_flag=True, help="Every layer's measures and the first differing rows.")
@click.option("--force", is_flag=True, help="Replace an existing --json or --plot file.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
def diff(source_a: Path, source_b: Path, layers_spec: str, align: str, kernel_spec: str, device: str,
         tie_ulps: float, weight_ulps: float, ignore_ties: bool, ignore_order: bool, max_flip_rate: float | None,
         json_path: str | None, plot_path: str | None, details: bool, force: bool, progress: bool) -> None:
    """Where and why two routings of the same tokens differ.

    A and B: traces, sharded traces, run folders, ids-only traces or the engines' routing
    outputs (vLLM, SGLang, Megatron, FlashInfer-Trace). A source's recorded topk_ids/weights are
    compared where it holds them; logits alone are routed with its own router spec. Exit 0
    identical (or within --ignore-ties, --ignore-order, --max-flip-rate), 1 different, 2 trouble.
    """
    from routetool.io.files import check_output_paths, require_input

    for p in (source_a, source_b):
        require_input(p, what="file or folder")
    kernel_file = None if kernel_spec == "reference" else kernel_source(kernel_spec)
    check_output_paths([json_path, plot_path], force=force, inputs=[source_a, source_b, kernel_file])
    from routetool.analysis.diff import Source, diff_sources
    from routetool.analysis.replay import parse_layers
    from routetool.engine.execution import select_execution
    from routetool.report.formats import write_json
    from routetool.report.diff import diff_json, render_diff, write_diff_plot

    execution = select_execution(device)
    with kernel_stdout(json_path == "-"):
        kernel = None
        if kernel_spec != "reference":
            from routetool.engine.execution import load_kernel

            kernel = load_kernel(kernel_spec)
        a = Source(source_a, "A")
        try:
            b = Source(source_b, "B")
            try:
                held = sorted({layer for s in (a, b) for _, layer in s.units})
                layers = None if layers_spec == "all" else parse_layers(layers_spec, held, f"{source_a} and {source_b}")
                with _progress(progress) as bar:
                    task = bar.add_task(markup_safe(f"diff {source_a.name} {source_b.name}"), total=None)
                    result = diff_sources(a, b, layers=layers, align=align, tie_ulps=tie_ulps, weight_ulps=weight_ulps,
                                          ignore_ties=ignore_ties, ignore_order=ignore_order,
                                          max_flip_rate=max_flip_rate, device=execution.device, kernel=kernel,
                                          progress=lambda n: bar.advance(task, n))
            finally:
                b.close()
        finally:
            a.close()
    console = Console(stderr=json_path == "-")
    render_diff(result, console, details=details)
    if json_path is not None:
        write_json(diff_json(result), json_path, sys.stdout)
    if plot_path is not None:
        write_diff_plot(result, plot_path)
    click.get_current_context().exit(result.exit_code)
