"""The report's plots: PNG files drawn with matplotlib's object-oriented API (Agg, no pyplot, no global state)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ds_cluster.planning.plan import Plan

MAX_HEATMAP_RANKS = 8
MAX_HEATMAP_STEPS = 160


def _new_figure(width: float, height: float):
    # The object-oriented API needs no pyplot and no global backend: the PNG is drawn by Agg.
    try:
        from matplotlib.figure import Figure
    except ImportError as err:  # an extra: training never plots
        raise ImportError("the report's plots need matplotlib, which is not installed: "
                          "pip install 'ds_cluster[report]'") from err

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _save(figure, path: Path) -> str:
    figure.savefig(path, format="png", metadata={"Software": None})
    return path.name


def plot_cluster_sizes(plan: Plan, path: Path) -> str:
    figure = _new_figure(8, 3.5)
    axes = figure.subplots()
    clusters = np.arange(plan.num_clusters)
    axes.bar(clusters - 0.2, plan.cluster_sizes, width=0.4, label="size", color="#9ecae1")
    axes.bar(clusters + 0.2, plan.kept_sizes, width=0.4, label="kept", color="#3182bd")
    axes.set_xlabel("cluster")
    axes.set_ylabel("samples")
    axes.set_title(f"cluster sizes and kept samples ({plan.num_kept} of {plan.num_samples} kept)")
    if plan.num_clusters <= 40:
        axes.set_xticks(clusters)
    axes.legend()
    return _save(figure, path)


def plot_weights(plan: Plan, path: Path) -> str:
    summary = plan.summary()
    weights = plan.weights[plan.selected]
    figure = _new_figure(8, 3.2)
    axes = figure.subplots()
    axes.hist(weights, bins=min(50, max(5, plan.num_clusters * 2)), color="#6baed6", edgecolor="#08519c")
    axes.axvline(1.0, color="#a50f15", linestyle="--", label="weight 1")
    axes.set_xlabel("loss weight of a kept sample")
    axes.set_ylabel("kept samples")
    axes.set_title(f"weights {summary['weight_min']:.3f}..{summary['weight_max']:.3f}, effective sample size "
                   f"{summary['effective_sample_size']:.0f} of {plan.num_kept}")
    axes.legend()
    return _save(figure, path)


def plot_rank_step_heatmap(counts: np.ndarray, path: Path) -> str:
    """One panel per rank (at most MAX_HEATMAP_RANKS): clusters up, steps across, colour = samples."""
    steps, world, num_clusters = counts.shape
    ranks = min(world, MAX_HEATMAP_RANKS)
    shown = counts[:MAX_HEATMAP_STEPS, :ranks]
    figure = _new_figure(9, 1.2 + ranks * max(0.9, min(2.5, 0.12 * num_clusters)))
    from matplotlib.ticker import MaxNLocator  # after _new_figure, which says which extra a missing one needs
    panels = np.atleast_1d(figure.subplots(ranks, 1, sharex=True, squeeze=False)[:, 0])
    vmax = max(int(shown.max()) if shown.size else 1, 1)
    image = None
    for rank, axes in enumerate(panels):
        image = axes.imshow(shown[:, rank, :].T, aspect="auto", interpolation="nearest", cmap="viridis",
                            vmin=0, vmax=vmax, origin="lower")
        axes.set_ylabel(f"rank {rank}\ncluster")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    panels[-1].set_xlabel("optimizer step (epoch 0)")
    title = f"samples of each cluster per rank and step: {steps} steps, {world} ranks"
    if steps > MAX_HEATMAP_STEPS or world > ranks:
        title += f" (first {min(steps, MAX_HEATMAP_STEPS)} steps, {ranks} ranks shown)"
    panels[0].set_title(title)
    if image is not None:
        figure.colorbar(image, ax=list(panels), label="samples")
    return _save(figure, path)


def plot_projection(plan: Plan, rows: np.ndarray, coords: np.ndarray, explained: np.ndarray, path: Path) -> str:
    figure = _new_figure(7, 6)
    axes = figure.subplots()
    labels = plan.labels[rows]
    kept = plan.weights[rows] > 0
    colours = _cluster_colours(plan.num_clusters)
    for cluster in range(plan.num_clusters):
        mine = labels == cluster
        axes.scatter(coords[mine & ~kept, 0], coords[mine & ~kept, 1], s=6, color=colours[cluster], alpha=0.2)
        axes.scatter(coords[mine & kept, 0], coords[mine & kept, 1], s=10, color=colours[cluster],
                     label=f"cluster {cluster}" if plan.num_clusters <= 16 else None)
    axes.set_xlabel(f"PC 1 ({100 * explained[0]:.1f}% of variance)")
    axes.set_ylabel(f"PC 2 ({100 * explained[1]:.1f}% of variance)")
    axes.set_title(f"features, 2-D PCA of {len(rows)} samples (faint: not kept)")
    if plan.num_clusters <= 16:
        axes.legend(fontsize="small", markerscale=1.5)
    return _save(figure, path)


def plot_category_heatmap(names: list[str], counts: np.ndarray, purity: float, path: Path) -> str:
    num_clusters = counts.shape[0]
    figure = _new_figure(max(5, 0.6 * len(names) + 2), max(3, 0.35 * num_clusters + 1.5))
    axes = figure.subplots()
    image = axes.imshow(counts, aspect="auto", interpolation="nearest", cmap="Blues")
    axes.set_xticks(np.arange(len(names)), labels=names, rotation=45, ha="right")
    axes.set_yticks(np.arange(num_clusters))
    axes.set_ylabel("cluster")
    axes.set_title(f"clusters against categories (purity {purity:.3f})")
    if counts.size <= 400:
        threshold = counts.max() / 2 if counts.size else 0
        for (row, col), value in np.ndenumerate(counts):
            axes.text(col, row, str(value), ha="center", va="center", fontsize=7,
                      color="white" if value > threshold else "black")
    figure.colorbar(image, ax=axes, label="samples")
    return _save(figure, path)


def _cluster_colours(num_clusters: int) -> list:
    from matplotlib import colormaps

    palette = colormaps["tab20" if num_clusters > 10 else "tab10"]
    return [palette(i % palette.N) for i in range(num_clusters)]


def plot_schedule(lines: list[dict], num_clusters: int, path: Path) -> str:
    """The adaptive schedule over the run: each cluster's sampling share and its loss (probe, else training) at
    the end of every window, one line per cluster (a schedule log's lines, as rank 0 wrote them)."""
    figure = _new_figure(9, 6)
    share_axes, loss_axes = figure.subplots(2, 1, sharex=True)
    steps = [line["step"] for line in lines]
    colours = _cluster_colours(num_clusters)
    for cluster in range(num_clusters):
        shares = [line["shares"][cluster] for line in lines]
        losses = [_tracked(line, cluster) for line in lines]
        share_axes.plot(steps, shares, marker=".", color=colours[cluster], label=str(cluster))
        loss_axes.plot(steps, losses, marker=".", color=colours[cluster])
    share_axes.set_ylabel("sampling share of the next window")
    share_axes.set_title(f"adaptive schedule: {len(lines)} windows, kept fraction {lines[-1]['kept_fraction']:.3f}"
                         if lines else "adaptive schedule: no window closed")
    loss_axes.set_ylabel("loss in the window (probe, else training)")
    loss_axes.set_xlabel("optimizer step")
    if num_clusters <= 16:
        share_axes.legend(fontsize="small", ncol=min(num_clusters, 8), title="cluster")
    return _save(figure, path)


def _tracked(line: dict, cluster: int) -> float:
    probe = line.get("probe_loss")
    value = probe[cluster] if probe is not None and probe[cluster] is not None else line["train_loss"][cluster]
    return float("nan") if value is None else float(value)
