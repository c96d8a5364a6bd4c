"""install()/uninstall() and DeepSpeed versions: a warning outside the tested range, an error only for what is
missing."""
from __future__ import annotations

import logging
import types

import pytest

from ds_cluster.integrations import deepspeed as hook


def _fake_deepspeed(version: str, **remove: bool) -> types.SimpleNamespace:
    """A module-like object with what the hook checks for; names in `remove` are left out."""
    import deepspeed

    engine_methods = {name: getattr(deepspeed.DeepSpeedEngine, name) for name in hook._REQUIRED_ENGINE_METHODS
                      if not remove.get(name)}
    engine = type("DeepSpeedEngine", (), engine_methods)
    members = {"initialize": deepspeed.initialize, "init_distributed": deepspeed.init_distributed,
               "DeepSpeedEngine": engine, "__version__": version}
    return types.SimpleNamespace(**{name: value for name, value in members.items() if not remove.get(name)})


@pytest.fixture(autouse=True)
def fresh_warnings():
    hook._warn_if_untested.cache_clear()
    yield
    hook._warn_if_untested.cache_clear()


def test_tested_versions_pass_silently(caplog):
    with caplog.at_level(logging.WARNING):
        hook.check_deepspeed(_fake_deepspeed("0.19.5"))
        hook.check_deepspeed(_fake_deepspeed("0.19.8+cpu"))
    assert caplog.text == ""


@pytest.mark.parametrize("version", ["0.20.0", "1.0.0", "0.18.9", "not-a-version"])
def test_a_version_outside_the_tested_range_gets_one_warning_not_an_error(version, caplog):
    with caplog.at_level(logging.WARNING):
        hook.check_deepspeed(_fake_deepspeed(version))
        hook.check_deepspeed(_fake_deepspeed(version))  # install() called twice: still one warning
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"tested with deepspeed>=0.19.5,<0.20 and found deepspeed {version}" in warnings[0].getMessage()


@pytest.mark.parametrize("missing,named", [("initialize", "deepspeed.initialize"),
                                           ("save_checkpoint", "DeepSpeedEngine.save_checkpoint"),
                                           ("gradient_accumulation_steps",
                                            "DeepSpeedEngine.gradient_accumulation_steps")])
def test_something_the_hook_needs_missing_is_an_error_naming_it(missing, named):
    with pytest.raises(RuntimeError, match=rf"cannot hook this DeepSpeed \(0.21.0\): it has no {named}\b"):
        hook.check_deepspeed(_fake_deepspeed("0.21.0", **{missing: True}))


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


def test_install_under_a_newer_deepspeed_warns_and_still_hooks(monkeypatch, caplog):
    import deepspeed

    import ds_cluster

    original = deepspeed.initialize
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    try:
        with caplog.at_level(logging.WARNING):
            ds_cluster.install()
        assert getattr(deepspeed.initialize, "_ds_cluster_hook", False)
        assert "found deepspeed 0.20.1" in caplog.text
    finally:
        deepspeed.initialize = original
