"""Command-line front of the capture side: ``routetool synth``, ``routetool info`` and
``routetool capture hf``.

Each command parses its options, calls one function, renders, and exits; a bad input is a
:class:`~routetool.errors.RouteToolError`, which the main group turns into one line and exit
code 2. The commands are registered on the main group by :mod:`routetool.cli`
(``main.add_command(synth)``, ``main.add_command(info)``, ``main.add_command(capture)``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from routetool.cli.command import (
    Run,
    check_output_paths,
    force_option,
    json_option,
    progress_bar,
    progress_option,
    run_command,
)
from routetool.cli.paths import PATH
from routetool.errors import RouteToolError, printable
from routetool.io.jsonstrict import JSONProblem, loads
from routetool.numtext import list_items, number_problem, parse_int
from routetool.report.sinks import JsonSink, Sinks
from routetool.report.tables import Console, markup_safe

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32",
           "bf16": "bfloat16", "fp16": "float16"}


def _torch_dtype(name: str):
    import torch

    return getattr(torch, _DTYPES[name])


def _parse_chunks(text: str) -> tuple[int, ...]:
    if text.strip().lower() in ("", "none", "0"):
        return ()
    values = [parse_int(x) for x in list_items("--prefill", text, "512,512,97")]
    if any(v is None for v in values):
        raise RouteToolError(f"--prefill {text!r}: expected token counts like 384,128 (or none)",
                             fix="e.g. --prefill 512,512,97")
    return tuple(values)


def _parse_overrides(items: tuple[str, ...]) -> dict:
    """``--set KEY=VALUE`` (VALUE as JSON: a number, true/false, null, a "string", a list) -> dict.

    Raises:
        RouteToolError: an item without ``=`` or a key, a VALUE that is not JSON (it was
            taken as a string, which the config then held, e.g. ``--set hidden_size=6x4``), or a
            KEY given twice (the last value won silently).
    """
    out = {}
    given = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RouteToolError(f"--set {item!r} is not KEY=VALUE", fix="e.g. --set norm_topk_prob=false")
        if key in given:
            raise RouteToolError(f"--set {key} is given twice ({given[key]!r}, then {raw!r})",
                                 fix=f"give each key once, e.g. --set {key}={raw}")
        given[key] = raw
        try:
            value = loads(raw)
        except JSONProblem as exc:
            quoted = json.dumps(raw)
            what = "is not JSON" if type(exc) is JSONProblem else f"is refused: {exc.reason}"
            raise RouteToolError(f"--set {key}: the value {raw!r} {what}",
                                 fix=f"write a number, true, false, null or a quoted string, e.g. --set '{key}={quoted}'"
                                 ) from None
        out[key] = value
    return out


def _warn(line: str) -> None:
    click.echo(printable(f"routetool: warning: {line}"), err=True)


MAX_SEED = 2**63 - 1


def _affinity(ctx, param, value):
    """``--affinity``: auto (None) or a finite number in [0, 10]."""
    from routetool.capture.synth import MAX_AFFINITY

    if value is None or str(value).strip().lower() == "auto":
        return None
    problem = number_problem(value)
    if problem:  # float() reads other scripts' digits, underscores and spaces
        raise RouteToolError(f"--affinity {problem}", fix="or auto")
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not (math.isfinite(number) and 0 <= number <= MAX_AFFINITY):
        raise RouteToolError(f"--affinity {value!r} must be auto or a finite number in [0, {MAX_AFFINITY:g}]",
                             fix="e.g. --affinity auto, or --affinity 1.5")
    return number


def _std(ctx, param, value):
    """``--router-std`` / ``--bias-std``: None or a finite number in [0, 10]."""
    from routetool.capture.hf import std_problem

    problem = None if value is None else std_problem(param.opts[0], value)
    if problem:
        raise RouteToolError(problem[0], fix=problem[1])
    return value


# ---------------------------------------------------------------------------------------
# routetool synth
_SYNTH_EXPERTS = 1 << 16
"""The most experts synth writes per layer."""


def _router_options(command):
    """synth's options for the router, one per field of :class:`~routetool_kernels.spec.RouterSpec`
    (its metadata: option, help, kind), defaulting to MuseSpark1x's router
    (:data:`~routetool_kernels.spec.MUSESPARK1X`); the function receives them by field name."""
    from dataclasses import fields

    from routetool_kernels.spec import FIELD_INFO, MUSESPARK1X, RouterSpec

    types = {"int": click.IntRange(min=1), "int?": click.IntRange(min=1), "float": float, "float?": float,
             "bool?": click.Choice(["true", "false"], case_sensitive=False)}
    for f in reversed(fields(RouterSpec)):
        info, default = FIELD_INFO[f.name], getattr(MUSESPARK1X, f.name)
        kind = click.Choice(info["choices"]) if info["kind"].startswith("str") else types[info["kind"]]
        help_text = info["help"]
        if f.name == "num_experts":
            kind, help_text = click.IntRange(1, _SYNTH_EXPERTS), f"{help_text} 1-{_SYNTH_EXPERTS:,}."
        as_bool = (lambda ctx, param, value: None if value is None else value.lower() == "true") \
            if info["kind"] == "bool?" else None
        command = click.option(info["option"], f.name, type=kind, default=default, show_default=default is not None,
                               help=help_text, callback=as_bool)(command)
    return command


@click.command()
@click.option("-o", "--output", "--out", "out", type=PATH, required=True,
              help="Trace file to write (.safetensors). --out is an alias.")
@click.option("--layers", "num_layers", type=click.IntRange(1, 1024), default=4, show_default=True,
              help="MoE layers (1-1024).")
@_router_options
@click.option("--dtype", type=click.Choice(sorted(_DTYPES)), default="bfloat16", show_default=True,
              help="dtype of the stored logits.")
@click.option("--prefill", default="384,128", show_default=True, help="Prefill chunk sizes in tokens (none or 0: no prefill).")
@click.option("--decode-steps", type=click.IntRange(0, 1_000_000), default=16, show_default=True,
              help="Decode steps (0-1,000,000).")
@click.option("--max-decode-batch", type=click.IntRange(1, 1 << 20), default=48, show_default=True,
              help="Decode batches are drawn uniformly from 1..this.")
@click.option("--padding", default="graph", show_default=True,
              help="graph (pad decode batches to CUDA-graph sizes), none, or fraction:F (F of all rows padded).")
@click.option("--order", type=click.Choice(["prefill-first", "interleaved"]), default="prefill-first",
              show_default=True, help="Step order of prefill chunks and decode batches.")
@click.option("--skew", default="imbalance:3", show_default=True,
              help="Load skew: uniform, zipf:A, hot:N:F or imbalance:X[:S] (target max/mean per layer).")
@click.option("--affinity", default="auto", show_default=True, callback=_affinity,
              help="Token-expert affinity of the logit model (0-10); auto: 1.5, lowered for imbalance targets "
                   "below the level 1.5 gives.")
@click.option("--bias", type=click.Choice(["zero", "fitted"]), default="zero", show_default=True,
              help="zero, or fitted by DeepSeek-V3's auxiliary-loss-free update rule.")
@click.option("--bias-rate", type=float, default=1e-3, show_default=True, help="Update rate u of the bias fit (0-1).")
@click.option("--fit-steps", type=click.IntRange(0, 10_000), default=50, show_default=True,
              help="Bias updates (batches of 1024 tokens).")
@click.option("--ties", type=click.IntRange(0, 100_000), default=4, show_default=True,
              help="Rows per layer given an exact tie at the k-th boundary (at most the unpadded rows; "
                   "the default is lowered to them).")
@click.option("--nonfinite", type=click.IntRange(0, 100_000), default=0, show_default=True,
              help="Rows per layer given a NaN and a +inf logit (at most the unpadded rows not taken by --ties).")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True, help="Seed (0 to 2**63-1).")
@click.option("--model", "model_name", default="synthetic", show_default=True, help="Model name in the metadata.")
@click.option("--ranks", "num_ranks", type=click.IntRange(1, 1024), default=1, show_default=True,
              help="Data-parallel ranks: above 1, OUT is a run folder of rank-<r>/trace.safetensors, one "
                   "model (--seed) for all, rank r's tokens drawn with seed + r.")
@force_option("Replace an existing output file.")
@progress_option()
def synth(out: Path, num_layers: int, dtype: str, prefill: str, decode_steps: int,
          max_decode_batch: int, padding: str, order: str, skew: str, affinity: float | None, bias: str,
          bias_rate: float, fit_steps: int, ties: int, nonfinite: int, seed: int, model_name: str, num_ranks: int,
          force: bool, progress: bool, **router) -> None:
    """Write a synthetic trace with controlled shape, skew, padding, ties and bias.

    Deterministic for a given seed. Prints the realised statistics per layer (tokens,
    padded and non-finite rows, exact ties at the k-th boundary, max/mean load without and
    with the bias, the imbalance target and the affinity used), and a warning for targets
    the model cannot make. The model of the logits and the size limits are in docs/capture.md.

    With --ranks N, OUT is a run folder (docs/trace-format.md) of N data-parallel ranks, as a
    multi-process capture writes them: one model (router directions, skew, bias) for all, each
    rank's tokens drawn with its own seed (seed + r), its rank in the metadata; the statistics
    shown are rank 0's.
    """
    import shutil

    from routetool.capture.synth import SynthSpec, synth_warnings, synth_work, with_default_ties
    from routetool.io.paths import publish_folder, staged_folder
    from routetool.io.trace import RouterConfig
    from routetool.report.capture import render_synth

    staged = None
    if num_ranks > 1:
        _check_run_folder_output(out, force)
    else:
        check_output_paths([out], force=force, allow_stdout=False)
    spec = SynthSpec(
        num_layers=num_layers,
        router=RouterConfig(**router),
        dtype=_torch_dtype(dtype), prefill_chunks=_parse_chunks(prefill), decode_steps=decode_steps,
        max_decode_batch=max_decode_batch, padding=padding, order=order, skew=skew, bias=bias,
        bias_update_rate=bias_rate, fit_steps=fit_steps, ties=ties, nonfinite=nonfinite, seed=seed, model=model_name,
        affinity=affinity,
    )
    if click.get_current_context().get_parameter_source("ties") == click.core.ParameterSource.DEFAULT:
        spec = with_default_ties(spec)  # the default, not the user, asked for 4: a smaller trace holds fewer
    synth_work(spec)  # checks the spec and its sizes before any work
    from routetool.capture.synth import plan_steps
    from routetool.engine.stream import check_step_sizes

    E = spec.router.num_experts  # a step no command could read (engine/stream.py) is not written
    check_step_sizes(plan_steps(spec)[0], 4 * E, f"{E:,} experts' float32 scores", path=None,
                     fix="lower --prefill's chunk sizes or --max-decode-batch (a step is one prefill chunk or "
                         "decode batch)")
    if num_ranks > 1:  # written aside, then renamed whole: a killed run leaves no mix of old and new ranks
        staged = staged_folder(out)
    outs = [out] if staged is None else [staged / f"rank-{r}" / "trace.safetensors" for r in range(num_ranks)]
    try:
        stats = _synth_write(spec, outs, num_ranks, seed, force, progress, out)
    except BaseException:
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
        raise
    if staged is not None:
        publish_folder(staged, out, replace=force)
    render_synth(str(out / "rank-0" / "trace.safetensors" if staged is not None else out), stats, Console())
    for line in synth_warnings(stats):
        _warn(line)
    click.echo(printable(f"wrote {out}" + (f" ({num_ranks} ranks)" if num_ranks > 1 else "")), err=True)


def _check_run_folder_output(out: Path, force: bool) -> None:
    """Refuse, before any work, a run folder ``synth --ranks`` cannot write whole: ``out`` must
    be missing or an empty folder, or (with --force) a run folder holding only rank-<r> folders,
    which is replaced whole (anything else in it would be lost)."""
    import os
    import re

    from routetool.io.paths import check_output_folder, path_kind

    kind = path_kind(out)
    if kind not in ("missing", "folder"):
        raise RouteToolError("is not a folder, and a run folder of --ranks goes there", path=out,
                             fix="name a new folder, or drop --ranks")
    check_output_folder(out.parent)
    if kind != "folder":
        return
    entries = sorted(e.name for e in os.scandir(out))
    if not entries:
        return
    if not force:
        raise RouteToolError("already exists", path=out, fix="choose another folder or pass --force to replace "
                             "the run folder whole")
    others = [n for n in entries if not re.fullmatch(r"rank-[0-9]+", n)]
    if others:
        raise RouteToolError(f"holds {others[0]!r}, which is no rank-<r> folder; --force replaces a run folder whole "
                             "and would remove it", path=out, fix="choose another folder, or move that file away")
    from routetool.io.dumps import _is_trace_index

    for rank in entries:  # each rank folder holds its trace only: a file beside it would go with the folder
        if path_kind(out / rank) != "folder":
            raise RouteToolError(f"{rank} is no folder; --force replaces a run folder whole and would remove it",
                                 path=out, fix="choose another folder, or move that file away")
        for e in sorted(os.scandir(out / rank), key=lambda e: e.name):
            trace = e.is_file(follow_symlinks=False) and (e.name.endswith(".safetensors") or (
                e.name.endswith(".json") and _is_trace_index(Path(e.path))))
            if not trace:
                raise RouteToolError(f"{rank}/{e.name} is no trace file; --force replaces a run folder whole and would "
                                     "remove it", path=out, fix="choose another folder, or move that file away")


def _synth_write(spec, outs: list[Path], num_ranks: int, seed: int, force: bool, progress: bool, out: Path):
    """Generate and write ``synth``'s trace(s) to ``outs`` (rank r's tokens drawn with seed + r);
    returns rank 0's statistics (:func:`routetool.capture.synth.synth_stats`)."""
    import dataclasses

    from routetool.capture.synth import generate, synth_stats, synth_work
    from routetool.io.trace import write_trace

    total = synth_work(spec)
    with progress_bar(progress, percent=True) as bar:
        task = bar.add_task(markup_safe(f"synth {out.name}"), total=total * num_ranks)
        for r, target in enumerate(outs):
            rank_spec = spec if num_ranks == 1 else dataclasses.replace(spec, token_seed=(seed + r) % (MAX_SEED + 1))
            result = generate(rank_spec, progress=lambda n: bar.advance(task, n))
            meta = result.meta
            if num_ranks > 1:
                layout = {"rank": r, "world_size": num_ranks, "dp_rank": r, "dp_size": num_ranks}
                meta = dataclasses.replace(meta, extra={**meta.extra, **{k: str(v) for k, v in layout.items()},
                                                        "rank_source": "synth"})
                target.parent.mkdir(parents=True, exist_ok=True)
            if r == 0:
                stats = synth_stats(meta, result.layers, result.calibration, progress=lambda n: bar.advance(task, n))
            bar.update(task, description=f"write {target.name}")
            write_trace(target, meta, result.layers, force=force)
    return stats


# ---------------------------------------------------------------------------------------
# routetool info
@click.command()
@click.argument("trace", type=PATH)
@click.option("--scan", is_flag=True,
              help="Also read the data (one step at a time) to count padded rows and rows with non-finite logits.")
@json_option("Also write the facts as JSON to PATH ('-' = stdout; the tables then go to stderr).")
@force_option("Replace an existing --json file.")
@progress_option("Progress bar on stderr (--scan).")
def info(trace: Path, scan: bool, json_path: str | None, force: bool, progress: bool) -> None:
    """Show what TRACE holds: metadata, provenance, layers, steps, shapes, dtypes, sizes.

    TRACE is a .safetensors trace, a sharded trace's index (.json) or a run folder of
    rank-<r>/ traces (one row per rank). Reads headers only (fast on any size) unless --scan
    is given.
    """

    def analyse(run: Run):
        from routetool.io.info import check_trace_file, trace_info
        from routetool.io.inputs import open_input
        from routetool.report.capture import InfoReport

        check_trace_file(trace)
        with open_input(trace) as opened:
            with run.progress(shown=scan) as bar:
                task = bar.add_task(markup_safe(f"scan {trace.name}"),
                                    total=sum(r.trace.total_tokens for r in opened.ranks))
                infos = [trace_info(r.trace, scan=scan, progress=lambda n: bar.advance(task, n)) for r in opened.ranks]
            partial = opened.partial  # said first, as every command that reads a trace says it (report/partial.py)
        return InfoReport(opened, infos, partial)

    run_command(analyse, sinks=Sinks(JsonSink(json_path)), inputs=[trace], force=force, progress=progress)


# ---------------------------------------------------------------------------------------
# routetool capture hf
@click.group()
def capture() -> None:
    """Record traces from real model runs: HF transformers here; engines (vLLM through its plugin and
    ROUTETOOL_CAPTURE_DIR, SGLang or any engine through the Python API) as docs/capture.md says."""


MAX_CAPTURE_LOGITS = 2**30
"""Largest recording (rows x experts x layers) capture hf holds in memory."""


@capture.command("hf")
@click.option("--model", "model_path", type=PATH, default=None,
              help="Local checkpoint folder (from_pretrained, local files only).")
@click.option("--config", "config_path", type=PATH, default=None,
              help="A config.json (or a folder with one): seeded random weights.")
@click.option("--arch", type=click.Choice(["deepseek_v3", "kimi_k2", "glm4_moe", "deepseek_v2", "qwen3_moe",
                                           "qwen3_next", "qwen2_moe", "olmoe", "gpt_oss", "mixtral"]),
              metavar="ARCH", default=None,
              help="A small built-in config of this architecture, seeded random weights: deepseek_v3, kimi_k2, "
                   "glm4_moe, deepseek_v2, qwen3_moe, qwen3_next, qwen2_moe, olmoe, gpt_oss or mixtral.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config field (of --model, --config or --arch), VALUE as JSON; repeatable.")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
              help="Seed of the random weights (0 to 2**63-1).")
@click.option("--router-std", type=float, default=None, callback=_std,
              help="Redraw router weights from N(0, std^2) (random-weight models; 0-10, default 0.25, 0 = HF init).")
@click.option("--bias-std", type=float, default=None, callback=_std,
              help="Draw e_score_correction_bias from N(0, std^2) (random-weight models; 0-10, default 0.02).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="Model dtype (auto: the checkpoint's; float32 for random-weight models).")
@click.option("--text", "text_path", metavar="FILE|-", required=True, help="Input text file (UTF-8), or - for stdin.")
@click.option("--tokenizer", "tokenizer_mode", type=click.Choice(["auto", "checkpoint", "bytes"]), default="auto",
              show_default=True,
              help="auto: the checkpoint's tokenizer when it has one, else UTF-8 bytes; checkpoint: must load; bytes.")
@click.option("--batch", type=click.IntRange(1, 1 << 16), default=4, show_default=True, help="Prompts per batch.")
@click.option("--prompt-tokens", type=click.IntRange(1, 1 << 20), default=64, show_default=True,
              help="Tokens per prompt (consecutive slices of the text).")
@click.option("--max-new-tokens", type=click.IntRange(0, 1 << 16), default=8, show_default=True,
              help="Greedy tokens to generate: 1 prefill step + (N - 1) decode steps (0: one forward pass).")
@click.option("-o", "--output", "--out", "out", type=PATH, required=True,
              help="Trace file to write (.safetensors). --out is an alias.")
@click.option("--model-name", default=None, help="Model name in the trace metadata.")
@force_option("Replace an existing output file.")
@progress_option()
def capture_hf_command(model_path: Path | None, config_path: Path | None, arch: str | None, overrides: tuple[str, ...],
                       seed: int, router_std: float | None, bias_std: float | None, dtype: str, text_path: str,
                       tokenizer_mode: str, batch: int, prompt_tokens: int, max_new_tokens: int, out: Path,
                       model_name: str | None, force: bool, progress: bool) -> None:
    """Run a transformers MoE model on text and record every MoE layer's router.

    Records router logits, the bias (e_score_correction_bias, where the architecture has
    one) and the model's own top-k ids and weights, one step per forward pass, with the
    model's routing semantics in the trace's router. Supported: DeepSeek-V3 (with its groups)
    / Kimi-K2 / GLM-4.5 (sigmoid + bias), DeepSeek-V2, Qwen3-MoE, Qwen3-Next, Qwen2-MoE,
    OLMoE, Mixtral (softmax), gpt-oss (softmax over the top-k logits).
    """
    from routetool.capture import hf
    from routetool.report.capture import render_hf_capture
    from routetool.io.trace import write_trace

    sources = [name for name, v in (("--model", model_path), ("--config", config_path), ("--arch", arch)) if v]
    if len(sources) != 1:
        raise RouteToolError(f"give exactly one of --model, --config, --arch (got {', '.join(sources) or 'none'})",
                             fix="e.g. --arch deepseek_v3, or --model ./my-checkpoint")
    if model_path is not None and (router_std is not None or bias_std is not None):
        raise RouteToolError("--router-std and --bias-std apply to random-weight models (--config/--arch)",
                             fix="drop them: a checkpoint's router weights are its own")
    if model_path is None and tokenizer_mode == "checkpoint":
        raise RouteToolError("--tokenizer checkpoint needs --model", fix="random-weight models use UTF-8 bytes")
    check_output_paths([out], force=force, inputs=[text_path, config_path], allow_stdout=False)
    text = hf.read_text(text_path)
    source_name = "<stdin>" if text_path == "-" else text_path
    torch_dtype = None if dtype == "auto" else _torch_dtype(dtype)
    fields = _parse_overrides(overrides)
    if model_path is not None:
        source = " ".join([str(model_path), *(f"--set {o}" for o in overrides)])
        with hf.progress_bars(progress):  # --no-progress: transformers' own bars too
            model, tokenizer = hf.load_checkpoint(model_path, dtype=torch_dtype or "auto", tokenizer=tokenizer_mode,
                                                  overrides=fields, source=source)
        origin = f"checkpoint {model_path}{' with ' + ', '.join(overrides) if overrides else ''}"
    else:
        config = hf.load_config(config_path, **fields) if config_path is not None else hf.small_config(arch, **fields)
        source = config_path if config_path is not None else " ".join([f"--arch {arch}",
                                                                       *(f"--set {o}" for o in overrides)])
        hf.check_model_config(config, source)
        rs = hf.ROUTER_STD if router_std is None else router_std
        bs = hf.BIAS_STD if bias_std is None else bias_std
        _check_capture_size(hf, config, batch, prompt_tokens, max_new_tokens, source)
        model = hf.build_model(config, seed=seed, router_std=rs, bias_std=bs,
                               dtype=torch_dtype or _torch_dtype("float32"), source=source)
        tokenizer = None
        has_bias = hf.router_config_for(config)[0].has_bias
        origin = (f"{'config ' + str(config_path) if config_path else 'built-in small ' + arch + ' config'}"
                  f"{' with ' + ', '.join(overrides) if overrides else ''}, random weights seeded {seed}, router "
                  f"weights std {rs:g}" + (f", bias std {bs:g}" if has_bias else ""))
    if model_path is not None:
        _check_capture_size(hf, model.config, batch, prompt_tokens, max_new_tokens, source)
    ids = hf.encode_text(text, tokenizer, int(model.config.vocab_size))
    input_ids = hf.prompt_batch(ids, batch, prompt_tokens, source=source_name)
    tok = "checkpoint tokenizer" if tokenizer is not None else "UTF-8 bytes"
    name = model_name or (str(model_path) if model_path else f"transformers {type(model).__name__}, {origin}")
    model_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    provenance = (f"routetool capture hf: transformers {type(model).__name__} ({origin}, {model_dtype}); input {batch} "
                  f"prompts x {prompt_tokens} tokens ({tok}) of {source_name}; 1 prefill step + "
                  f"{max(max_new_tokens - 1, 0)} greedy decode steps; router logits, bias and the model's own "
                  "top-k ids/weights recorded by forward hooks")
    with progress_bar(progress) as bar:
        task = bar.add_task(f"capture {type(model).__name__} (forward passes)", total=max(1, max_new_tokens))
        meta, layers = hf.capture_hf(model, input_ids, max_new_tokens=max_new_tokens, model_name=name,
                                     provenance=provenance, source=source, progress=lambda n: bar.advance(task, n))
        bar.update(task, description=f"write {out.name}")
        write_trace(out, meta, layers, force=force)
    first = next(iter(layers.values()))
    summary = hf.HFCapture(
        out=str(out), model_name=name, family=hf.router_config_for(model.config)[0].name, layers=sorted(layers),
        router=meta.router, weights_semantics=meta.extra["weights_semantics"], batch=batch,
        prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens,
        tokenizer="checkpoint tokenizer" if tokenizer is not None else "UTF-8 byte fallback",
        num_steps=int(first.step_offsets.numel() - 1), tokens_per_layer=int(first.gating_output.shape[0]),
    )
    render_hf_capture(summary, Console())
    click.echo(printable(f"wrote {out}; replay it with: routetool replay {out}"), err=True)


def _check_capture_size(hf, config, batch: int, prompt_tokens: int, max_new_tokens: int, source) -> None:
    """Refuse a recording too large to hold in memory, before the model runs."""
    _, router, _ = hf.router_config_for(config, source)
    rows = batch * prompt_tokens + batch * max(max_new_tokens - 1, 0)
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    logits = rows * router.num_experts * layers
    if logits > MAX_CAPTURE_LOGITS:
        raise RouteToolError(
            f"the recording would hold up to {rows:,} rows x {router.num_experts:,} experts x {layers:,} layers = "
            f"{logits:,} logits; the limit is 2**30 = {MAX_CAPTURE_LOGITS:,} (it is held in memory)", path=source,
            fix="lower --batch, --prompt-tokens or --max-new-tokens")
