"""The hook changes nothing it does not own: a table of `deepspeed.initialize` call shapes, run with and without it.

Every row is run twice in one real DeepSpeed process (tests/workers/call_shapes_worker.py): with DeepSpeed's
own initialize and through `ds_cluster.install()`. Without an enabled cluster_sampling block the two
outcomes (engine, optimizer, loader and scheduler types, or the error raised) must be identical; with the
block enabled the loader is ds_cluster's and everything else is DeepSpeed's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launching import REPO, check, run_single

WORKER = str(REPO / "tests" / "workers" / "call_shapes_worker.py")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("call_shapes")
    check(run_single([WORKER, "--out", str(out)], timeout=400))
    return json.loads((Path(out) / "outcomes.json").read_text())


def _rows() -> list[str]:
    # The names the worker uses; kept here so each row is its own test case.
    shapes = ["config dict", "JSON path", "HJSON path", "args.deepspeed_config", "config_params", "no training_data",
              "collate_fn", "dist_init_required=False", "parameter groups", "mpu", "args and config both (ambiguous)"]
    return [f"{kind}: {shape}" for kind in ("absent", "disabled", "enabled") for shape in shapes] + [
        "no config at all", "config path that does not exist", "duplicate keys in the JSON"]


@pytest.mark.integration
@pytest.mark.parametrize("row", _rows())
def test_call_shape(outcomes: dict, row: str):
    outcome = outcomes[row]
    without, with_hook = outcome["without"], outcome["with"]
    if outcome["block"] != "enabled" or without["error"] is not None:
        # Not ours (no block, block disabled, or a call DeepSpeed itself refuses): exactly DeepSpeed's answer.
        assert with_hook == without
        return
    if row.endswith("no training_data"):
        assert with_hook["error"] == "ValueError: cluster_sampling is enabled but training_data is None"
        return
    assert with_hook["error"] is None, with_hook
    assert with_hook["loader"] == "ClusterDataLoader" and without["loader"] == "DeepSpeedDataLoader"
    for part in ("engine", "optimizer", "scheduler"):
        assert with_hook[part] == without[part], part


@pytest.mark.integration
def test_the_table_covers_what_deepspeed_refuses_too(outcomes: dict):
    """The error rows really are errors in DeepSpeed (so the identical outcome above means something)."""
    for row in ("no config at all", "config path that does not exist", "duplicate keys in the JSON",
                "enabled: args and config both (ambiguous)"):
        assert outcomes[row]["without"]["error"], row
    assert "Duplicate keys" in outcomes["duplicate keys in the JSON"]["without"]["error"]
    for kind in ("absent", "disabled", "enabled"):  # every config form is one DeepSpeed accepts
        for form in ("config dict", "JSON path", "HJSON path", "args.deepspeed_config", "config_params"):
            assert outcomes[f"{kind}: {form}"]["without"]["error"] is None, (kind, form)
    assert set(outcomes) == set(_rows())
