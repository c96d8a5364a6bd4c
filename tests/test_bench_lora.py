"""The quality benchmark's LoRA recipe (`--recipe peft=lora`) and its `recommended_lora` arm: what the spec asks of
the job, and the seeded adapter folder the `lora` features are read through."""
from __future__ import annotations

import pytest
import torch

from bench.real import STORIES260K_DIR, T0_DIR
from bench.toy.tasks import write_mixture
from tests.test_bench_quality import _settings, _spec
from tests.workers.feature_fixtures import tiny_llama


def test_the_lora_recipe_tells_the_job_to_train_adapters_and_its_arm_reads_lora_features(tmp_path):
    """peft=lora reaches the job (and the work folder's record, so a LoRA run never resumes a full one's arms);
    recommended_lora clusters the `lora` features of an adapter folder in the work folder, read from the training
    data as it is (no separate feature model's re-encoding)."""
    from bench.harness.instrument import instrument_record

    write_mixture(tmp_path / "data", seed=5, total=240, heldout_per_family=3)
    argv = ["--model", "smollm2", "--data", str(tmp_path / "data"), "--work-dir", str(tmp_path / "work"),
            "--seeds", "1", "--arms", "random,recommended,recommended_lora",
            "--recipe", "peft=lora,lora_rank=4,train_fraction=1.0"]
    settings = _settings(argv)
    spec = _spec(settings)
    assert (spec["peft"], spec["lora_rank"]) == ("lora", 4)
    assert instrument_record(settings)["peft"] == "lora" and instrument_record(settings)["lora_rank"] == 4
    arm = next(arm for arm in spec["arms"] if arm["setting"] == "recommended_lora_f0.3")
    assert arm["cluster_sampling"]["feature_kind"] == "lora" and "feature_model" not in arm["cluster_sampling"]
    features = spec["analyses"][spec["analyses"][arm["analysis"]]["features"]]
    assert features["source"] == "lora" and features["cluster_sampling"]["feature_kind"] == "lora"
    assert features["model"] == str(tmp_path / "work" / "analyses" / "lora_adapters_r4")
    own = next(arm for arm in spec["arms"] if arm["setting"] == "recommended_f0.3")
    assert spec["analyses"][own["analysis"]]["features"] != arm["analysis"]  # lm_head and lora apart
    full = _settings(argv[:-1] + ["train_fraction=1.0"])
    assert _spec(full)["peft"] == "none" and "peft" not in instrument_record(full)
    with pytest.raises(SystemExit, match="peft=qlora"):
        _settings(argv[:-1] + ["peft=qlora"])


def test_the_feature_adapters_are_written_once_seeded_and_load_as_the_base_with_trainable_adapters(tmp_path):
    from bench.harness.lora import FEATURE_ADAPTER_SEED, ensure_feature_adapters
    from ds_cluster.data.models import load_model, with_lora

    base = tmp_path / "base"
    tiny_llama(seed=0).save_pretrained(base)
    folder = ensure_feature_adapters(tmp_path / "adapters", base, rank=4)
    loaded = load_model(folder)
    trainable = {name: p for name, p in loaded.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    # The same seed builds the same adapters in every process (each rank of the job; the arm that trains them).
    rebuilt = dict(with_lora(load_model(base), 4, seed=FEATURE_ADAPTER_SEED).named_parameters())
    assert all(torch.equal(p, rebuilt[name]) for name, p in trainable.items())
    state = torch.get_rng_state()
    with_lora(load_model(base), 4, seed=FEATURE_ADAPTER_SEED)
    assert torch.equal(state, torch.get_rng_state())  # the caller's generator is left as it was
    assert not any(torch.equal(p, dict(with_lora(load_model(base), 4, seed=1).named_parameters())[name])
                   for name, p in trainable.items() if "lora_A" in name)
    written = (folder / "adapter_config.json").stat().st_mtime_ns
    assert ensure_feature_adapters(folder, base, rank=4) == folder
    assert (folder / "adapter_config.json").stat().st_mtime_ns == written
    assert not folder.with_name("adapters.partial").exists()


@pytest.mark.slow
@pytest.mark.integration
def test_the_jobs_lora_feature_analysis_writes_its_adapters_once_and_reads_every_record_on_two_ranks(tmp_path):
    """The benchmark job's `recommended_lora` features under the instrument's DeepSpeed config (bf16 block, ZeRO-0,
    2 ranks, deepspeed launcher): the adapter folder over the local base, then one projected adapter gradient per
    record, none empty or zero (fresh adapters' lora_B is zero, so only lora_B's gradient is there: the feature
    still sees each record), its cost recorded as the `lora` source's."""
    import gzip
    import json

    from tests.launching import check, run_deepspeed

    records = tmp_path / "records.jsonl.gz"
    with gzip.open(T0_DIR / "train.jsonl.gz", "rt", encoding="utf-8") as handle:
        lines = [line for _, line in zip(range(24), handle)]
    with gzip.open(records, "wt", encoding="utf-8") as handle:
        handle.writelines(lines)
    check(run_deepspeed(["tests/workers/bench_lora_features_worker.py", "--records", str(records),
                         "--out", str(tmp_path)], timeout=420))
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["shape"] == [24, 64] and result["finite"] and result["empty"] == 0 and result["zero_rows"] == 0
    assert result["cost"]["source"] == "lora" and result["cost"]["extract_wall"] > 0
    assert result["adapter_config"]["base_model_name_or_path"] == str(STORIES260K_DIR)
    assert result["adapter_config"]["r"] == 4
