"""What a cluster is, in words a user can read before trusting the plan to drop most of it: its size, kept count
and weight, its mix of categories, the words of its prompts that set it apart from the other clusters, and the
prompts nearest its centre. Plain data in and out; the page renders it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ds_cluster.planning.plan import Plan

# Defaults of the report: words per cluster, example prompts per cluster, characters kept of each example.
NUM_WORDS = 8
NUM_EXAMPLES = 3
EXAMPLE_CHARS = 200


@dataclass(frozen=True)
class ClusterDescription:
    """One cluster as the report shows it. `words` and `examples` are empty when the text is left out."""

    cluster: int
    size: int
    kept: int
    weight: float
    categories: list[tuple[str, int]] = field(default_factory=list)  # most common first
    words: list[str] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)  # nearest the centre first, cut to EXAMPLE_CHARS


def describe_clusters(plan: Plan, *, prompts: Optional[Sequence[str]] = None,
                      categories: Optional[Sequence[str]] = None,
                      num_words: int = NUM_WORDS, num_examples: int = NUM_EXAMPLES,
                      example_chars: int = EXAMPLE_CHARS) -> list[ClusterDescription]:
    """One description per cluster of `plan`.

    prompts: the prompt text of every analysed sample (N), or None to leave the text out (words and examples);
    categories: a category per sample (N), or None. The examples are the members nearest their k-means centre
    (the plan's distances; ties, as in a labels-only analysis without distances, by sample order).
    """
    for name, values in (("prompts", prompts), ("categories", categories)):
        if values is not None and len(values) != plan.num_samples:
            raise ValueError(f"{name} has {len(values)} entries but the plan {plan.num_samples} samples")
    weight_of = np.zeros(plan.num_clusters)
    weight_of[plan.labels[plan.selected]] = plan.weights[plan.selected]
    members = [np.flatnonzero(plan.labels == cluster) for cluster in range(plan.num_clusters)]
    words = (distinguishing_words(prompts, plan.labels, plan.num_clusters, num_words)
             if prompts is not None else [[] for _ in members])
    descriptions = []
    for cluster, rows in enumerate(members):
        mix: list[tuple[str, int]] = []
        if categories is not None:
            names, counts = np.unique([str(categories[row]) for row in rows], return_counts=True)
            mix = sorted(zip(names.tolist(), counts.tolist()), key=lambda item: (-item[1], item[0]))
        examples = []
        if prompts is not None:
            nearest = _nearest_centre(rows, plan.distances, num_examples)
            examples = [_cut(prompts[row], example_chars) for row in nearest]
        descriptions.append(ClusterDescription(cluster=cluster, size=int(plan.cluster_sizes[cluster]),
                                               kept=int(plan.kept_sizes[cluster]), weight=float(weight_of[cluster]),
                                               categories=mix, words=words[cluster], examples=examples))
    return descriptions


def distinguishing_words(prompts: Sequence[str], labels: np.ndarray, num_clusters: int,
                         num_words: int = NUM_WORDS) -> list[list[str]]:
    """Per cluster, the words whose mean TF-IDF weight in the cluster's prompts most exceeds their mean in the
    other clusters' (scikit-learn's TfidfVectorizer, English stop words out), among the words a larger share of
    the cluster's prompts use than of the others' (so a word every prompt has never sets one apart, whatever
    the prompts' lengths). Samples with label < 0 count nowhere. A cluster with no such word gets none."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    labels = np.asarray(labels)
    included = np.flatnonzero(labels >= 0)
    empty: list[list[str]] = [[] for _ in range(num_clusters)]
    if included.size == 0:
        return empty
    vectorizer = TfidfVectorizer(stop_words="english", sublinear_tf=True, max_features=50_000,
                                 token_pattern=r"(?u)\b[^\W\d_][^\W\d_]+\b")  # words of two letters or more
    try:
        weights = vectorizer.fit_transform([prompts[row] for row in included])
    except ValueError:  # nothing but stop words and numbers
        return empty
    vocabulary = vectorizer.get_feature_names_out()
    cluster_of = labels[included]
    sums = np.zeros((num_clusters, weights.shape[1]))
    uses = np.zeros((num_clusters, weights.shape[1]), dtype=np.int64)  # prompts that use each word
    for cluster in range(num_clusters):
        rows = weights[cluster_of == cluster]
        sums[cluster] = np.asarray(rows.sum(axis=0)).ravel()
        uses[cluster] = np.asarray((rows > 0).sum(axis=0)).ravel()
    counts = np.bincount(cluster_of, minlength=num_clusters).astype(float)
    total, everyone, total_uses = sums.sum(axis=0), counts.sum(), uses.sum(axis=0)
    result = []
    for cluster in range(num_clusters):
        if counts[cluster] == 0:
            result.append([])
            continue
        inside = sums[cluster] / counts[cluster]
        others = everyone - counts[cluster]
        outside = (total - sums[cluster]) / others if others else np.zeros_like(inside)
        score = inside - outside
        # Shares compared in integers: uses_in / n_in > uses_out / n_out.
        wider = uses[cluster] * int(others) > (total_uses - uses[cluster]) * int(counts[cluster])
        score = np.where(wider, score, 0.0)
        # Highest score first; ties broken by the word, so the same data gives the same words.
        order = np.lexsort((vocabulary, -score))
        result.append([str(vocabulary[i]) for i in order[:num_words] if score[i] > 0])
    return result


def _nearest_centre(rows: np.ndarray, distances: np.ndarray, count: int) -> list[int]:
    return rows[np.lexsort((rows, distances[rows]))[:count]].tolist()


def _cut(text: str, limit: int) -> str:
    text = " ".join(text.split())  # one line: the table cell stays readable
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"
