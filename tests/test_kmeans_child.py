"""k-means in a child process (ds_cluster/clustering/child.py): the same centres as in the process, and a caller that
asks for it (a training job's rank) never imports scikit-learn itself; others cluster in the process."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ds_cluster.clustering.child import sklearn_centroids, sklearn_centroids_in_child
from ds_cluster.clustering.kmeans import cluster_features, cluster_with
from ds_cluster.settings import ClusteringSettings


def _points(seed: int, rows: int = 600, dim: int = 24) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(6, dim)) * 4
    return (centres[rng.integers(0, 6, rows)] + rng.normal(size=(rows, dim))).astype(np.float32)


@pytest.mark.parametrize("seed", [0, 3])
def test_child_gives_the_in_process_centres_bit_for_bit(seed):
    points = _points(seed)
    here = sklearn_centroids(points, 6, 10, 300, seed)
    there = sklearn_centroids_in_child(points, 6, 10, 300, seed)
    assert there.dtype == here.dtype == np.float32
    assert np.array_equal(here, there)


def test_child_failure_is_an_error_with_its_reason():
    with pytest.raises(RuntimeError, match="k-means in a child process failed"):
        sklearn_centroids_in_child(_points(0, rows=4), 6, 1, 10, 0)  # more clusters than points


def _run_clustering(tmp_path, call: str) -> dict:
    """`call` (a ds_cluster.clustering.kmeans expression of `points`) in a fresh interpreter: its labels and
    centres, and which of scikit-learn's heavy imports it loaded."""
    np.save(tmp_path / "points.npy", _points(1))
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np
        from ds_cluster.clustering.kmeans import cluster_features, cluster_with
        from ds_cluster.settings import ClusteringSettings
        points = np.load({str(tmp_path / "points.npy")!r})
        result = {call}
        np.save({str(tmp_path / "centroids.npy")!r}, result.centroids)
        np.save({str(tmp_path / "labels.npy")!r}, result.labels)
        print(json.dumps({{"loaded": [m for m in ("sklearn", "pandas", "scipy.stats") if m in sys.modules]}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"loaded": json.loads(done.stdout.strip().splitlines()[-1])["loaded"],
            "centroids": np.load(tmp_path / "centroids.npy"), "labels": np.load(tmp_path / "labels.npy")}


def test_a_training_rank_that_clusters_does_not_import_sklearn(tmp_path):
    """`cluster_with(..., in_child=True)` (what a training job's rank calls) equals the in-process call, and
    scikit-learn (with the pandas and scipy.stats it imports) is never loaded into the calling process."""
    settings = ClusteringSettings(num_clusters=6, seed=1)
    there = _run_clustering(tmp_path, "cluster_with(points, ClusteringSettings(num_clusters=6, seed=1), 2, "
                                      "in_child=True)")
    assert there["loaded"] == []
    expected = cluster_with(_points(1), settings, 2)
    assert np.array_equal(there["centroids"], expected.centroids)
    assert np.array_equal(there["labels"], expected.labels)


def test_without_the_ask_clustering_stays_in_process(tmp_path):
    """A caller that does not train next (the CLI, a notebook) clusters in its own process."""
    here = _run_clustering(tmp_path, "cluster_features(points, num_clusters=6, seed=1)")
    assert "sklearn" in here["loaded"]
    assert np.array_equal(here["centroids"], cluster_features(_points(1), num_clusters=6, seed=1).centroids)
