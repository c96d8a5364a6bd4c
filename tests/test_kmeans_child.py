"""k-means in a child process (ds_cluster/clustering/child.py): the same centres as in the process, and a rank of a
distributed job that clusters never imports scikit-learn itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ds_cluster.clustering.child import in_distributed_job, sklearn_centroids, sklearn_centroids_in_child
from ds_cluster.clustering.kmeans import cluster_features


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


def test_outside_a_job_clustering_stays_in_process():
    assert not in_distributed_job()


def test_a_rank_that_clusters_does_not_import_sklearn(tmp_path):
    """A real gloo process group (one rank, loopback): cluster_features there equals the same call here, and
    scikit-learn (with the pandas and scipy.stats it imports) is never loaded into the rank."""
    from ds_cluster.distributed import free_port

    points = _points(1)
    np.save(tmp_path / "points.npy", points)
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        from ds_cluster.clustering.kmeans import cluster_features
        result = cluster_features(np.load({str(tmp_path / "points.npy")!r}), num_clusters=6, seed=1)
        np.save({str(tmp_path / "centroids.npy")!r}, result.centroids)
        np.save({str(tmp_path / "labels.npy")!r}, result.labels)
        print(json.dumps({{"loaded": [m for m in ("sklearn", "pandas", "scipy.stats") if m in sys.modules]}}))
        dist.destroy_process_group()
    """)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"loaded": []}
    expected = cluster_features(points, num_clusters=6, seed=1)
    assert np.array_equal(np.load(tmp_path / "centroids.npy"), expected.centroids)
    assert np.array_equal(np.load(tmp_path / "labels.npy"), expected.labels)
