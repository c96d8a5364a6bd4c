"""Each default written once: the block's model, the presets and every stage's settings read one declaration."""
from __future__ import annotations

import dataclasses

from ds_cluster.config import NOT_STAGE_KEYS, PAPER_PRESET, RECOMMENDED_PRESET, ClusterSamplingConfig
from ds_cluster.settings import STAGE_TYPES, LossSettings, StageSettings, default_of


def test_an_empty_block_derives_every_stages_own_defaults():
    assert ClusterSamplingConfig(enabled=True).stages() == StageSettings()


def test_every_key_has_one_default_that_the_block_and_every_stage_reading_it_share():
    fields = ClusterSamplingConfig.model_fields
    for key, field in fields.items():
        if key in NOT_STAGE_KEYS:
            continue
        declared = {item.default for stage in STAGE_TYPES for item in dataclasses.fields(stage)
                    if item.metadata.get("key") == key}
        assert declared == {default_of(key)}, key
        assert field.default == default_of(key), key


def test_the_recommended_preset_is_the_defaults_of_the_keys_the_paper_preset_fixes():
    assert list(RECOMMENDED_PRESET) == list(PAPER_PRESET)
    assert RECOMMENDED_PRESET == {key: default_of(key) for key in PAPER_PRESET}
    assert ClusterSamplingConfig(enabled=True, preset="recommended") == ClusterSamplingConfig(enabled=True,
                                                                                              preset="recommended",
                                                                                              **RECOMMENDED_PRESET)


def test_a_plan_that_records_no_loss_reduction_gets_the_blocks_default():
    assert LossSettings.recorded_in({}) == LossSettings() == ClusterSamplingConfig(enabled=True).stages().loss
    assert LossSettings.recorded_in({"loss_reduction": "sample"}).reduction == "sample"
