"""The training script (ds_cluster.train) with faults injected from the outside; started by tests/test_faults.py.

The training script itself is unchanged (no test-only code paths in it or in the
library): this wrapper patches around it, driven by environment variables.

    DS_CLUSTER_TEST_KILL_AFTER_STEP=K   the chosen rank SIGKILLs itself right after optimizer step K
    DS_CLUSTER_TEST_KILL_AFTER_SHARD=K  the chosen rank SIGKILLs itself after writing K feature-store shards
    DS_CLUSTER_TEST_KILL_RANK=R         which rank (default 1)
    DS_CLUSTER_TEST_RANK_ARGS=JSON      per-rank replacements of the training script's options, e.g.
                                        {"1": {"--data": "other.jsonl"}}: rank 1 gets other data
    DS_CLUSTER_TEST_SKEW_SHARES=R       rank R's adaptive schedule computes other shares than the others
                                        (its rule's state nudged), as a rank restored from another state would

The rank is read from RANK, which the deepspeed launcher sets before starting the script, else from Open MPI's
OMPI_COMM_WORLD_RANK under mpirun.
"""
from __future__ import annotations

import json
import os
import signal
import sys

KILL_AFTER_STEP_VAR = "DS_CLUSTER_TEST_KILL_AFTER_STEP"
KILL_RANK_VAR = "DS_CLUSTER_TEST_KILL_RANK"
KILL_AFTER_SHARD_VAR = "DS_CLUSTER_TEST_KILL_AFTER_SHARD"
RANK_ARGS_VAR = "DS_CLUSTER_TEST_RANK_ARGS"
SKEW_SHARES_VAR = "DS_CLUSTER_TEST_SKEW_SHARES"
SKEW_FROM_WINDOW_VAR = "DS_CLUSTER_TEST_SKEW_FROM_WINDOW"  # the first window drawn at skewed shares (default 1)


def replace_options(argv: list[str], replacements: dict[str, str]) -> list[str]:
    """argv with the value after each named option replaced (the option must be present)."""
    argv = list(argv)
    for option, value in replacements.items():
        argv[argv.index(option) + 1] = value
    return argv


def kill_after_step(step_limit: int) -> None:
    """SIGKILL this process as soon as the engine finishes optimizer step `step_limit`."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original_step = DeepSpeedEngine.step

    def step_then_maybe_die(self, *args, **kwargs):
        result = original_step(self, *args, **kwargs)
        if self.global_steps >= step_limit:
            # SIGKILL, not an exception: nothing gets to clean up, as when a node dies.
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    DeepSpeedEngine.step = step_then_maybe_die


def kill_after_shards(shard_limit: int) -> None:
    """SIGKILL this process right after it has written `shard_limit` feature-store shards."""
    from ds_cluster.features.store import FeatureStore

    original_write = FeatureStore.write_shard
    written = []

    def write_then_maybe_die(self, *args, **kwargs):
        result = original_write(self, *args, **kwargs)
        written.append(result)
        if len(written) >= shard_limit:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    FeatureStore.write_shard = write_then_maybe_die


def skew_shares(from_window: int) -> None:
    """This rank's adaptive rule returns shares a little off the others' (every rule), for the windows from
    `from_window` on (the window the shares are for: 1 is the first the rule draws)."""
    import numpy as np

    from ds_cluster.planning.shares import ADAPTIVE_RULES

    for rule in ADAPTIVE_RULES.values():
        original = type(rule).update

        def nudged(self, state, figures, natural, active, window, exploration, _original=original):
            shares, state = _original(self, state, figures, natural, active, window, exploration)
            if window >= from_window:
                shares = shares + np.where(shares > 0, 1e-3, 0.0)
            return shares / shares.sum(), state

        type(rule).update = nudged


def main() -> int:
    rank = os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    argv = sys.argv[1:]
    per_rank = json.loads(os.environ.get(RANK_ARGS_VAR, "{}"))
    argv = replace_options(argv, per_rank.get(rank, {}))
    if KILL_AFTER_STEP_VAR in os.environ and rank == os.environ.get(KILL_RANK_VAR, "1"):
        kill_after_step(int(os.environ[KILL_AFTER_STEP_VAR]))
    if KILL_AFTER_SHARD_VAR in os.environ and rank == os.environ.get(KILL_RANK_VAR, "1"):
        kill_after_shards(int(os.environ[KILL_AFTER_SHARD_VAR]))
    if os.environ.get(SKEW_SHARES_VAR) == rank:
        skew_shares(int(os.environ.get(SKEW_FROM_WINDOW_VAR, "1")))
    from ds_cluster import train

    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main())
