"""scikit-learn's k-means, in this process or in a child process for the rank of a training job that clusters.

Importing scikit-learn's KMeans imports pandas and scipy.stats with it: 139-163 MB of resident memory that the
process keeps for its life (measured on this project's machines). A training rank that clustered would carry that
into every training step, above what its peers and plain DeepSpeed hold; the training job asks for the child
(`kmeans.cluster_with(..., in_child=True)`). The child (``python -m
ds_cluster.clustering.child POINTS CENTROIDS ARGUMENTS``) imports numpy and scikit-learn only, runs the very same
function on the very same float32 points (written to and read back from a ``.npy`` file, exactly), and exits,
giving its memory back; the centres are the in-process call's, bit for bit (tests/test_kmeans_child.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# The package's parent folder: the child imports this very ds_cluster, installed or not.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def sklearn_centroids(points: np.ndarray, num_clusters: int, n_init: int, max_iter: int, seed: int) -> np.ndarray:
    """scikit-learn's KMeans (k-means++, `n_init` restarts, `seed`): the best run's centres, float32 (K, d)."""
    from sklearn.cluster import KMeans

    model = KMeans(n_clusters=num_clusters, init="k-means++", n_init=n_init, max_iter=max_iter, random_state=seed)
    model.fit(points)
    return model.cluster_centers_.astype(np.float32)


def sklearn_centroids_in_child(points: np.ndarray, num_clusters: int, n_init: int, max_iter: int,
                               seed: int) -> np.ndarray:
    """`sklearn_centroids` run in a child process: the same centres."""
    points = np.ascontiguousarray(points, dtype=np.float32)
    with tempfile.TemporaryDirectory(prefix="ds_cluster_kmeans_") as folder:
        points_path, centroids_path = Path(folder) / "points.npy", Path(folder) / "centroids.npy"
        np.save(points_path, points)
        arguments = {"num_clusters": num_clusters, "n_init": n_init, "max_iter": max_iter, "seed": seed}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [_PACKAGE_ROOT] + [part for part in os.environ.get("PYTHONPATH", "").split(os.pathsep) if part])}
        done = subprocess.run([sys.executable, "-m", "ds_cluster.clustering.child", str(points_path),
                               str(centroids_path), json.dumps(arguments)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"k-means in a child process failed (exit {done.returncode}):\n"
                               f"{done.stdout.strip()[-4000:]}")
        return np.load(centroids_path)


def main(argv: list[str]) -> int:
    """The child: read the points, write the centres."""
    points_path, centroids_path, arguments = argv
    points = np.load(points_path)
    np.save(centroids_path, sklearn_centroids(points, **json.loads(arguments)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
