"""PNG figures of a balance result (matplotlib, an optional extra: :func:`routetool.errors.install_extra`).

matplotlib is imported only when a figure is drawn, with the non-interactive Agg backend.
Files are written atomically (temporary file in the same folder, then rename) and an
existing figure is replaced only with ``force``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from typing import TYPE_CHECKING

from routetool.errors import RouteToolError, install_extra, printable
from routetool.io.paths import atomic_write, claim_outputs, missing_folders, path_kind

if TYPE_CHECKING:  # importing it would import torch, and --plot's checks run before any work
    from routetool.analysis.balance import BalanceResult

FIGURES = ("expert_load_heatmap.png", "balancedness_eplb.png", "rank_load.png")
"""Files :func:`write_balance_plots` writes (the EPLB figure shows the EP placements
alone when EPLB was not computed)."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RouteToolError("--plot needs matplotlib, which is not installed",
                             fix=install_extra("plot")) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def check_plot_dir(folder: str | os.PathLike, force: bool) -> Path:
    """Fail early (before any work): ``-`` or an empty path given, matplotlib missing, the
    folder or one of its parents not a folder (a file, a dangling link), the folder not
    creatable or not writable, a figure already there without ``force``.

    A missing folder and its missing parents are created when the figures are written
    (``mkdir -p``). Writability is probed: the missing folders are created, a temporary file
    is created in the folder (and removed), and the folders created are removed again, so
    nothing is left behind.

    Raises:
        RouteToolError: with the fix.
    """
    if str(folder) == "-":
        raise RouteToolError("--plot needs a folder; figures cannot go to stdout", path="-",
                             fix="name a folder, e.g. --plot figs")
    if str(folder) == "":  # (Path("") is the current folder)
        raise RouteToolError("--plot needs a folder; an empty path names none", path="''",
                             fix="name a folder, e.g. --plot figs, or --plot . for the current folder")
    _pyplot()  # (after the name: a wrong name is said first, whatever is installed)
    folder = Path(folder)
    if path_kind(folder) in ("file", "special"):
        raise RouteToolError("is not a folder", path=folder, fix="name a folder for the figures")
    existing, missing = missing_folders(folder)  # the folders to create, innermost first
    if missing and path_kind(existing) != "folder":
        raise RouteToolError(f"is not a folder, so --plot {folder} cannot be created in it", path=existing,
                             fix="choose another folder for --plot")
    created = []
    try:
        for d in reversed(missing):
            if path_kind(d) != "missing":  # (a path through '..' may reach a folder already made)
                continue
            try:
                d.mkdir()
            except OSError as exc:
                raise RouteToolError(f"cannot create the folder ({exc.strerror or exc})", path=d,
                                     fix="choose a writable folder for --plot") from None
            created.append(d)
        try:
            fd, probe = tempfile.mkstemp(prefix=".routetool-plot.", suffix=".probe", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise RouteToolError(f"cannot write figures here ({exc.strerror or exc})", path=folder,
                                 fix="choose a writable folder for --plot") from None
    finally:
        for d in reversed(created):
            try:
                d.rmdir()
            except OSError:
                pass
    for name in FIGURES:
        f = folder / name
        if path_kind(f) in ("folder", "special"):
            raise RouteToolError(f"holds {name}, which is not a regular file", path=folder,
                                 fix="choose another folder for --plot")
    if not force:
        existing = [name for name in FIGURES if path_kind(folder / name) != "missing"]
        if existing:
            raise RouteToolError(f"already holds {', '.join(existing)}", path=folder,
                                 fix="choose another folder or pass --force to replace them")
    claim_outputs(figure_paths(folder), force=force)  # (written only where still absent, without force)
    return folder


def figure_paths(folder: str | os.PathLike) -> list[Path]:
    """The files :func:`write_balance_plots` may write into ``folder``."""
    return [Path(folder) / name for name in FIGURES]


def _save(fig, path: Path, plt) -> None:
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png"), suffix=".png")
    except RouteToolError:
        raise
    except Exception as exc:  # noqa: BLE001 - a drawing failure must not end in a traceback
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")[:120]
        raise RouteToolError(f"cannot draw the figure ({type(exc).__name__}: {first})", path=path,
                             fix="report it; the other outputs were written") from None
    finally:
        plt.close(fig)


def write_balance_plots(result: BalanceResult, folder: str | os.PathLike, *, force: bool = False) -> list[Path]:
    """Write the figures of ``result`` into ``folder`` (created with its parents if missing).

    * ``expert_load_heatmap.png``: layer x expert, assignments / layer mean;
    * ``balancedness_eplb.png``: per-layer balancedness, contiguous vs EPLB (and every EP
      placement analysed);
    * ``rank_load.png``: assignments per EP rank of the most imbalanced layer, before and
      after EPLB, and layer x rank load / mean heatmaps before and after.

    Returns:
        The paths written.

    Raises:
        RouteToolError: matplotlib missing (the fix: :func:`routetool.errors.install_extra`), existing
            figures without ``force``, an unwritable folder.
    """
    plt = _pyplot()
    import numpy as np

    folder = check_plot_dir(folder, force)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RouteToolError(f"cannot create the folder ({exc.strerror or exc})", path=folder,
                             fix="choose a writable folder for --plot") from None
    written = []
    layers = [x.layer for x in result.layers]
    title = printable(f"{result.model or Path(result.source).name}")  # (metadata: no control characters drawn)

    # 1. heatmap
    load = np.array([x.counts for x in result.layers], dtype=float)
    mean = load.mean(axis=1, keepdims=True)
    rel = np.divide(load, mean, out=np.zeros_like(load), where=mean > 0)
    fig, ax = plt.subplots(figsize=(max(7, min(16, 4 + result.num_experts / 16)), min(14, 2.2 + 0.28 * len(layers))))
    im = ax.imshow(rel, aspect="auto", cmap="magma", interpolation="nearest",
                   vmin=0, vmax=max(2.0, float(np.percentile(rel, 99.5)) if rel.size else 2.0))
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    step = max(1, len(layers) // 20)
    ax.set_yticks(range(0, len(layers), step))
    ax.set_yticklabels([str(layers[i]) for i in range(0, len(layers), step)])
    ax.set_title(f"{title}: tokens per expert / layer mean ({result.routing})")
    fig.colorbar(im, ax=ax, label="load / mean (1 = even)")
    path = folder / FIGURES[0]
    _save(fig, path, plt)
    written.append(path)

    # 2. balancedness per layer
    fig, ax = plt.subplots(figsize=(max(6, min(16, 0.25 * len(layers) + 4)), 4))
    x = np.arange(len(layers))
    markers = "os^vD"
    for i, ep in enumerate(result.ep):
        vals = [r.ranks[i].balancedness if r.ranks[i].balancedness is not None else np.nan for r in result.layers]
        ax.plot(x, vals, marker=markers[i % len(markers)], linestyle="-", label=f"{ep.placement}")
    if result.eplb is not None:
        e = result.eplb
        before = [y.balancedness_before if y.balancedness_before is not None else np.nan for y in e.layers]
        after = [y.balancedness_after if y.balancedness_after is not None else np.nan for y in e.layers]
        hold = [y.holdout_after if y.holdout_after is not None else np.nan for y in e.layers]
        if not any(ep.num_ranks == e.num_gpus and ep.placement.startswith("contiguous") for ep in result.ep):
            ax.plot(x, before, marker="o", color="tab:gray", label=f"contiguous ep={e.num_gpus}")
        ax.plot(x, after, marker="s", color="tab:green", linewidth=2,
                label=f"EPLB {e.policy}, {e.num_redundant} redundant, G={e.num_gpus} (in-sample)")
        if not np.all(np.isnan(hold)):
            ax.plot(x, hold, marker="x", color="tab:olive", linestyle="--", label="EPLB fitted on first half (holdout)")
    ax.set_xticks(x[::max(1, len(layers) // 30)])
    ax.set_xticklabels([str(layers[i]) for i in range(0, len(layers), max(1, len(layers) // 30))])
    ax.set_ylim(0, 1.05)
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("balancedness (mean / max rank load)")
    ax.set_title(f"{title}: balancedness per layer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    path = folder / FIGURES[1]
    _save(fig, path, plt)
    written.append(path)

    # 3. rank load: the worst layer's ranks as bars, layer x rank heatmaps before / after EPLB
    if result.eplb is not None:
        e = result.eplb
        before = np.array([y.rank_load_before for y in e.layers], dtype=float)
        after = np.array([y.rank_load_after for y in e.layers], dtype=float)
        name_b, name_a = f"contiguous ep={e.num_gpus}", f"EPLB {e.policy}, {e.num_redundant} redundant"
    elif result.ep:
        before = np.array([r.ranks[0].assignments for r in result.layers], dtype=float)
        after = None
        name_b, name_a = result.ep[0].placement, ""
    else:
        before = after = None
    if before is not None:
        panels = 3 if after is not None else 2
        fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.8),
                                 gridspec_kw={"width_ratios": [1.2] + [1] * (panels - 1)})
        ax1 = axes[0]
        mb = before.mean(axis=1, keepdims=True)
        rel_b = np.divide(before, mb, out=np.zeros_like(before), where=mb > 0)
        worst = int(np.argmax(rel_b.max(axis=1))) if rel_b.size else 0
        G = before.shape[1]
        xr = np.arange(G)
        width = 0.4 if after is not None else 0.8
        ax1.bar(xr - (width / 2 if after is not None else 0), before[worst], width, label=name_b, color="tab:orange")
        if after is not None:
            ax1.bar(xr + width / 2, after[worst], width, label=name_a, color="tab:green")
        ax1.axhline(before[worst].mean(), color="black", linewidth=0.8, linestyle="--", label="mean")
        ax1.set_xlabel("EP rank")
        ax1.set_ylabel("assignments")
        ax1.set_title(f"layer {layers[worst]} (most imbalanced): load per EP rank")
        ax1.legend(fontsize=8, loc="lower right")
        ax1.set_xticks(xr[::max(1, G // 16)])
        rels = [(rel_b, name_b)]
        if after is not None:
            ma = after.mean(axis=1, keepdims=True)
            rels.append((np.divide(after, ma, out=np.zeros_like(after), where=ma > 0), name_a))
        vmax = max(1.5, max(float(r.max()) for r, _ in rels if r.size))
        step = max(1, len(layers) // 20)
        for ax, (rel, name) in zip(axes[1:], rels):
            im = ax.imshow(rel, aspect="auto", cmap="magma", interpolation="nearest", vmin=0, vmax=vmax)
            ax.set_xlabel("EP rank")
            ax.set_ylabel("layer")
            ax.set_yticks(range(0, len(layers), step))
            ax.set_yticklabels([str(layers[i]) for i in range(0, len(layers), step)])
            ax.set_title(f"rank load / mean: {name}", fontsize=10)
        fig.colorbar(im, ax=list(axes[1:]), label="load / mean (1 = even)")
        fig.suptitle(title)
        path = folder / FIGURES[2]
        _save(fig, path, plt)
        written.append(path)
    return written
