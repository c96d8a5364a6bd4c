"""The HTML report: `write_report` takes plain data and writes a self-contained folder, index.html and PNG plots
(matplotlib, Agg), relative links only, no script, no external resource.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
import logging
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from ds_cluster.fileio import write_text_atomic
from ds_cluster.planning.plan import Plan
from ds_cluster.report.clusters import ClusterDescription, describe_clusters
from ds_cluster.report.plots import (plot_category_heatmap, plot_cluster_sizes, plot_projection, plot_rank_step_heatmap,
                                     plot_schedule, plot_weights)
from ds_cluster.report.target import cluster_affinities
from ds_cluster.report.summary import (cluster_category_counts, cluster_counts_per_rank_step, pca_projection,
                                       layout_coverage)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the HTML report
_CSS = """
body { font-family: sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
th { background: #f0f0f0; } td.name, th.name { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; }
p.note { color: #555; font-size: 0.9em; }
td.text { text-align: left; font-size: 0.85em; max-width: 520px; }
td.text ol { margin: 0; padding-left: 1.2em; }
"""


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], names: int = 1) -> str:
    """An HTML table; the first `names` columns are left-aligned text."""
    def cell(tag: str, index: int, value: Any) -> str:
        css = ' class="name"' if index < names else ""
        return f"<{tag}{css}>{html.escape(str(value))}</{tag}>"

    lines = ["<table>", "<tr>" + "".join(cell("th", i, h) for i, h in enumerate(header)) + "</tr>"]
    lines += ["<tr>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>" for row in rows]
    lines.append("</table>")
    return "\n".join(lines)


def _figure(name: str, alt: str) -> str:
    return f'<p><img src="{html.escape(name)}" alt="{html.escape(alt)}"></p>'


def _plan_section(plan: Plan, out: Path) -> list[str]:
    summary = plan.summary()
    coverage = layout_coverage(plan, epoch=0)
    weight_of = np.zeros(plan.num_clusters)
    weight_of[plan.labels[plan.selected]] = plan.weights[plan.selected]
    return [
        "<h2>Plan</h2>",
        _table(["", "value"], [
            ("samples", summary["num_samples"]),
            ("left out (no response tokens)", summary["num_excluded"]),
            ("clusters", summary["num_clusters"]),
            ("kept", f"{summary['num_kept']} ({100 * summary['kept_fraction']:.1f}%)"),
            ("weights", f"{summary['weight_min']:.3f} .. {summary['weight_max']:.3f}"),
            ("effective sample size", f"{summary['effective_sample_size']:.1f}"),
            ("batch", f"world {summary['world_size']} x micro {summary['micro_batch_size']} x accumulation "
                      f"{summary['gradient_accumulation_steps']} = {summary['global_batch_size']}"),
            ("steps per epoch", summary["steps_per_epoch"]),
            ("allocation", summary["allocation"]),
            ("clusters per global step (epoch 0)",
             f"min {coverage['clusters_per_step_min']}, mean {coverage['clusters_per_step_mean']:.2f}"),
            ("clusters per rank and step (epoch 0)",
             f"min {coverage['clusters_per_rank_step_min']}, mean {coverage['clusters_per_rank_step_mean']:.2f}"),
            ("plan fingerprint", summary["fingerprint"]),
        ]),
        _table(["cluster", "size", "kept", "weight"], [
            (c, int(plan.cluster_sizes[c]), int(plan.kept_sizes[c]), f"{weight_of[c]:.3f}")
            for c in range(plan.num_clusters)]),
        _figure(plot_cluster_sizes(plan, out / "cluster_sizes.png"), "cluster sizes against kept sizes"),
        _figure(plot_weights(plan, out / "weights.png"), "distribution of sample weights"),
    ]


def _features_section(plan: Plan, features: Optional[np.ndarray], max_points: int, out: Path) -> list[str]:
    parts = ["<h2>Features</h2>"]
    included = np.flatnonzero(plan.labels >= 0)
    if features is not None and included.size >= 2:
        rows, coords, explained = pca_projection(features, included, max_points=max_points, seed=plan.seed)
        parts.append(_figure(plot_projection(plan, rows, coords, explained, out / "projection.png"),
                             "2-D projection of the features coloured by cluster"))
    else:
        parts.append('<p class="note">No features in the analysis (labels only): no projection.</p>')
    return parts


def _categories_section(plan: Plan, categories: Optional[Sequence[str]], out: Path,
                        records_note: Optional[str] = None) -> list[str]:
    parts = ["<h2>Clusters and categories</h2>"]
    if categories is None or len(categories) != plan.num_samples or not any(categories):
        why = (f"No records: {records_note}" if records_note else
               "The data has no category (or family) column")
        parts.append(f'<p class="note">{html.escape(why)}: no cluster-versus-category table.</p>')
        return parts
    names, category_counts_, purity_value = cluster_category_counts(plan.labels, categories, plan.num_clusters)
    parts.append(f"<p>Purity {purity_value:.3f}: the share of samples in their cluster's most common category.</p>")
    parts.append(_figure(plot_category_heatmap(names, category_counts_, purity_value, out / "categories.png"),
                         "heat map of clusters against categories"))
    majority = [names[int(row.argmax())] if row.sum() else "" for row in category_counts_]
    parts.append(_table(["cluster", "majority", *names],
                        [(c, majority[c], *category_counts_[c].tolist()) for c in range(plan.num_clusters)], names=2))
    return parts


def _clusters_section(descriptions: Sequence[ClusterDescription], text_left_out: bool,
                      records_note: Optional[str] = None) -> list[str]:
    parts = ["<h2>What each cluster holds</h2>"]
    if text_left_out:
        parts.append('<p class="note">The records\' text is left out of this report (--no-text): no words, no '
                     'example prompts.</p>')
    elif not any(d.examples for d in descriptions):
        why = f"No records: {records_note}" if records_note else "No prompt text was given"
        parts.append(f'<p class="note">{html.escape(why)}: no words, no example prompts.</p>')
    else:
        parts.append('<p class="note">Words: the prompt words whose TF-IDF weight in the cluster most exceeds their '
                     'weight in the other clusters. Examples: the prompts nearest the cluster\'s centre in feature '
                     'space, cut short.</p>')
    header = ["cluster", "size", "kept", "weight", "categories", "words", "prompts nearest the centre"]
    rows = ["<table>", "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
    for d in descriptions:
        mix = ", ".join(f"{name} {count}" for name, count in d.categories[:4])
        if len(d.categories) > 4:
            mix += f", {len(d.categories) - 4} more"
        examples = "".join(f"<li>{html.escape(example)}</li>" for example in d.examples)
        rows.append(f"<tr><td>{d.cluster}</td><td>{d.size}</td><td>{d.kept}</td><td>{d.weight:.3f}</td>"
                    f'<td class="text">{html.escape(mix)}</td><td class="text">{html.escape(", ".join(d.words))}</td>'
                    f'<td class="text">{"<ol>" + examples + "</ol>" if examples else ""}</td></tr>')
    rows.append("</table>")
    return parts + ["\n".join(rows)]


def _target_section(plan: Plan, features: Optional[np.ndarray], target: Any, include_text: bool) -> list[str]:
    counts = ", ".join(f"{name} {count}" for name, count in target.counts().items())
    parts = ["<h2>Target</h2>",
             f"<p>{len(target.groups)} target examples ({html.escape(counts)}), fingerprint "
             f"{html.escape(target.fingerprint)}, read from {html.escape(str(target.source or 'records in memory'))}."
             " Per cluster: the target examples nearest its centre, the mean similarity of its records to the target "
             "(each record's largest cosine to a target example), and what the plan kept of it.</p>"]
    if features is None:
        return parts + ['<p class="note">No features in the analysis: no affinity to the target.</p>']
    header = ["cluster", "target examples nearest", "targets served", "mean similarity", "kept",
              "kept: mean similarity"] + (["examples it serves"] if include_text else [])
    rows = ["<table>", "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
    for row in cluster_affinities(plan, features, target):
        served = ", ".join(f"{name} {count}" for name, count in row.served)
        cells = [str(row.cluster), str(row.nearest_examples), html.escape(served), f"{row.mean_similarity:.3f}",
                 str(row.kept), "" if np.isnan(row.kept_mean_similarity) else f"{row.kept_mean_similarity:.3f}"]
        line = "".join(f"<td>{cell}</td>" for cell in cells)
        if include_text:
            line += ('<td class="text"><ol>' + "".join(f"<li>{html.escape(prompt[:160])}</li>" for prompt in
                                                        row.prompts) + "</ol></td>")
        rows.append(f"<tr>{line}</tr>")
    return parts + ["\n".join(rows + ["</table>"])]


def _schedule_section(plan: Plan, lines: Sequence[dict], out: Path) -> list[str]:
    last = lines[-1]
    stopped = ", ".join(str(c) for c in last["stopped"]) or "none"
    return ["<h2>Adaptive schedule</h2>",
            f"<p>{len(lines)} windows closed, up to optimizer step {last['step']}; samples consumed "
            f"{sum(last['samples_consumed'])} of {plan.num_samples} (kept fraction {last['kept_fraction']:.3f}); "
            f"clusters stopped: {html.escape(stopped)}{'; the run finished' if last['finished'] else ''}.</p>",
            _figure(plot_schedule(list(lines), plan.num_clusters, out / "schedule.png"),
                    "sampling shares and per-cluster loss over the optimizer steps"),
            _table(["cluster", "samples consumed", "of its size", "stopped at step", "why",
                    "predicted gain (nats)", "realized gain (nats)", "last share", "last loss (training)"],
                   [_schedule_row(plan, lines, c) for c in range(plan.num_clusters)])]


def _schedule_row(plan: Plan, lines: Sequence[dict], cluster: int) -> tuple:
    """A cluster's row of the adaptive schedule: what it consumed, and with the automatic budget when it stopped,
    why, the gain its learning curve still predicted then (for as many steps again) and the gain it made after
    (its loss when it stopped minus its last loss in the log, from its maintenance share and the cool-down)."""
    last = lines[-1]
    stop = (last.get("stops") or [None] * plan.num_clusters)[cluster]
    later = [line["train_loss"][cluster] for line in lines
             if stop is not None and line["step"] > stop["step"] and line["train_loss"][cluster] is not None]
    realized = f"{stop['loss'] - later[-1]:+.4f}" if later else ""
    predicted = "" if stop is None or stop.get("predicted_gain") is None else f"{stop['predicted_gain']:.4f}"
    return (cluster, last["samples_consumed"][cluster],
            f"{last['samples_consumed'][cluster] / max(int(plan.cluster_sizes[cluster]), 1):.2f}",
            "" if stop is None else stop["step"], "" if stop is None else f"{stop['signal']}: {stop.get('why', '')}",
            predicted, realized, f"{last['shares'][cluster]:.3f}",
            "" if last["train_loss"][cluster] is None else f"{last['train_loss'][cluster]:.4f}")


@dataclass(frozen=True)
class ReportInputs:
    """What a report shows beside the plan, each optional.

    features: the analysis's (N, d) features, for the 2-D projection; categories: a category per sample (N; a
    task family, say), for the cluster-versus-category table; prompts: the prompt text of every sample (N), for
    what each cluster holds (its distinguishing words and the prompts nearest its centre); include_text=False
    leaves every record's text out of the page (for data that must not be copied into a report); schedule_lines:
    an adaptive run's schedule log (one dict per window), for its shares and per-cluster loss over the steps;
    sources: name -> value lines shown at the top (config, analysis...); records_note: why there are no records
    (prompts, categories), shown where they would be; target: the analysis's target examples (`AnalysisDir.
    load_target()`), for each cluster's affinity to them (with the features).
    """

    features: Optional[np.ndarray] = None
    categories: Optional[Sequence[str]] = None
    prompts: Optional[Sequence[str]] = None
    include_text: bool = True
    schedule_lines: Optional[Sequence[dict]] = None
    title: str = "ds_cluster plan report"
    sources: Optional[dict[str, str]] = None
    max_projection_points: int = 4000
    records_note: Optional[str] = None
    target: Any = None


def write_report(out_dir: Union[str, Path], plan: Plan, inputs: Optional[ReportInputs] = None) -> Path:
    """Write `out_dir/index.html` and its PNG plots for a plan and what else it is given; returns the HTML's path."""
    shown = inputs or ReportInputs()
    features, categories, prompts = shown.features, shown.categories, shown.prompts
    include_text, schedule_lines, title = shown.include_text, shown.schedule_lines, shown.title
    sources, max_projection_points, records_note = shown.sources, shown.max_projection_points, shown.records_note
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = [f"<h1>{html.escape(title)}</h1>"]
    if sources:
        parts.append(_table(["input", "value"], sorted(sources.items()), names=2))
    parts += _plan_section(plan, out)
    descriptions = describe_clusters(plan, prompts=prompts if include_text else None, categories=categories)
    parts += _clusters_section(descriptions, text_left_out=not include_text, records_note=records_note)
    if shown.target is not None:
        parts += _target_section(plan, features, shown.target, include_text)
    if schedule_lines:
        parts += _schedule_section(plan, schedule_lines, out)
    parts.append("<h2>Layout: samples of each cluster per rank and step (epoch 0)</h2>")
    parts.append(_figure(plot_rank_step_heatmap(cluster_counts_per_rank_step(plan, epoch=0),
                                                out / "rank_step_heatmap.png"),
                         "heat map of cluster counts per rank per step"))
    parts += _features_section(plan, features, max_projection_points, out)
    parts += _categories_section(plan, categories, out, records_note)
    document = ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
                f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
                + "\n".join(parts) + "\n</body>\n</html>\n")
    index = out / "index.html"
    write_text_atomic(index, document)
    logger.info("report written to %s", index)
    return index
