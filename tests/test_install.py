"""install()/uninstall() and the tested DeepSpeed range, without starting processes."""
from __future__ import annotations

import pytest


def test_version_outside_the_tested_range_is_a_clear_error():
    from ds_cluster.integrations.deepspeed import check_deepspeed_version

    check_deepspeed_version("0.19.5")
    check_deepspeed_version("0.19.8+cpu")
    for version in ("0.18.9", "0.20.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=r"tested with deepspeed >=0.19.5,<0.20 and found deepspeed"):
            check_deepspeed_version(version)


def test_install_is_idempotent_and_uninstall_restores_deepspeed():
    import deepspeed

    import ds_cluster

    original = deepspeed.initialize
    try:
        ds_cluster.install()
        hooked = deepspeed.initialize
        assert hooked is not original and getattr(hooked, "_ds_cluster_hook", False)
        ds_cluster.install()
        assert deepspeed.initialize is hooked  # not wrapped twice
        ds_cluster.uninstall()
        assert deepspeed.initialize is original
    finally:
        deepspeed.initialize = original
