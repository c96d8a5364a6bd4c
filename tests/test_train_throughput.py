"""bench/train_throughput.py --lora: the line that states LoRA's time per step against full fine-tuning's."""
from __future__ import annotations

from bench.harness.instrument import SMOLLM2_RECIPE
from bench.train_throughput import LORA_SETTINGS, lora_ratio_line


def test_lora_ratio_is_the_mean_lora_step_over_the_mean_full_step():
    # Two repeats each, alternated as LORA_SETTINGS runs them; the host's drift is averaged out of both.
    rows = [{"lora_rank": 0, "seconds_per_step": 3.0, "trainable_parameters": 134_515_008},
            {"lora_rank": 8, "seconds_per_step": 1.0, "trainable_parameters": 2_442_240},
            {"lora_rank": 0, "seconds_per_step": 5.0, "trainable_parameters": 134_515_008},
            {"lora_rank": 8, "seconds_per_step": 2.0, "trainable_parameters": 2_442_240}]
    line = lora_ratio_line(rows)
    assert "1.50 s per optimizer step against 4.00 s" in line
    assert "0.38 of its time" in line  # 1.5 / 4.0 = 0.375
    assert "2,442,240 trainable" in line and "(134,515,008)" in line


def test_lora_settings_alternate_full_and_lora_on_the_benchmark_recipe():
    ranks = [setting[-1] for setting in LORA_SETTINGS]
    assert ranks == [0, 8, 0, 8]
    # The SmolLM2 benchmark's recipe (ZeRO-0, DeepSpeed's bf16 block, micro batch 4, no accumulation), so the
    # ratio is the one its LoRA grid pays.
    recipe = tuple(SMOLLM2_RECIPE[key] for key in ("zero_stage", "precision", "micro_batch_size",
                                                   "gradient_accumulation_steps"))
    assert {setting[1:5] for setting in LORA_SETTINGS} == {recipe}
