"""What the frontends' integrations (axolotl, LLaMA-Factory) share, tested here without either frontend installed:
the rows module importing without TRL, where a YAML's block comes from, the refusals' form, the check of "auto"
batch sizes on CPU, the trainer class bound to a block, the guard; and the Trainer mixin's resume with DataLoader
worker processes, which axolotl's default (1 worker) showed up. The frontends' own command lines run in
tests/test_axolotl.py and tests/test_llamafactory.py (marker `frontends`)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_cluster.integrations.frontends import (FrontendRowsMixin, Refusal, bind_block, check_batch_size_not_auto_on_cpu,
                                               check_refusals, frontend_block, rendered_records_path,
                                               require_cluster_trainer)
from ds_cluster.integrations.rows import PaddedRowsView, rendered_record
from tests.launching import REPO


def test_the_shared_rows_import_without_trl_and_the_old_name_still_works():
    # TRL made unimportable: the rows module and the frontends' shared module load all the same.
    script = ("import sys\nsys.modules['trl'] = None\n"
              "import ds_cluster.integrations.rows, ds_cluster.integrations.frontends\n"
              "print(sorted(m for m in ('trl', 'axolotl', 'llamafactory') if sys.modules.get(m)))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"
    from ds_cluster.integrations.trl import PaddedRowsView as FromTrl

    assert FromTrl is PaddedRowsView


def test_padded_rows_view_pads_with_masked_positions():
    import datasets

    rows = datasets.Dataset.from_list([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
                                       {"input_ids": [8], "labels": [8]}])
    view = PaddedRowsView(rows, pad_token_id=0)
    assert view.width == 3 and len(view) == 2
    item = view[1]
    assert item["input_ids"].tolist() == [8, 0, 0] and item["attention_mask"].tolist() == [1, 0, 0]
    assert item["labels"].tolist() == [8, -100, -100]


def test_a_row_is_rendered_as_its_prompt_and_its_trained_tokens():
    class Characters:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    row = {"input_ids": [ord(c) for c in "Q?A!"], "labels": [-100, -100, ord("A"), ord("!")]}
    assert rendered_record(row, Characters()) == {"prompt": "Q?", "completion": "A!"}
    assert str(rendered_records_path("runs/analysis")).endswith("runs/analysis.records.jsonl")


def _json_with_block(path: Path, block: dict | None) -> Path:
    config = {"zero_optimization": {"stage": 3}}
    if block is not None:
        config["data_efficiency"] = {"enabled": True, "data_sampling": {"enabled": True, "cluster_sampling": block}}
    path.write_text(json.dumps(config))
    return path


def test_the_block_comes_from_the_yaml_key_or_the_deepspeed_json_never_both(tmp_path: Path):
    block = {"enabled": True, "budget_ratio": 0.3, "analysis_path": str(tmp_path / "analysis")}
    from_key = frontend_block(block, None, "axolotl")
    assert from_key.top_level and from_key.config.budget_ratio == 0.3 and from_key.ds_config is None
    from_json = frontend_block(None, str(_json_with_block(tmp_path / "with.json", block)), "axolotl")
    assert not from_json.top_level and from_json.config.budget_ratio == 0.3
    assert from_json.source.endswith("with.json: data_efficiency.data_sampling.cluster_sampling")
    with pytest.raises(ValueError, match="given twice"):
        frontend_block(block, str(tmp_path / "with.json"), "axolotl")
    with pytest.raises(ValueError, match="no cluster_sampling block .*has no data_efficiency"):
        frontend_block(None, str(_json_with_block(tmp_path / "without.json", None)), "LLaMA-Factory")
    with pytest.raises(ValueError, match="no `deepspeed:` JSON"):
        frontend_block(None, None, "LLaMA-Factory")
    with pytest.raises(ValueError, match=r"axolotl YAML: cluster_sampling: unknown key 'budget_ration' \(did you mean"):
        frontend_block({**block, "budget_ration": 0.3}, None, "axolotl")
    with pytest.raises(ValueError, match="analysis_path is not set"):
        frontend_block({"enabled": True}, None, "axolotl")
    # Off: nothing else is asked of it.
    assert not frontend_block({"enabled": False}, None, "axolotl").config.enabled


def test_refusals_name_every_option_that_is_on_with_its_reason_and_fix():
    refusals = (Refusal("sample_packing", "packing joins records", "sample_packing: false"),
                Refusal("stage", "another stage", "stage: sft", lambda stage: stage != "sft"))
    check_refusals({"sample_packing": False, "stage": "sft"}, refusals, "axolotl")
    with pytest.raises(ValueError) as refused:
        check_refusals({"sample_packing": True, "stage": "dpo"}, refusals, "axolotl")
    assert str(refused.value) == ("axolotl: cluster_sampling cannot follow 2 option(s) of this YAML (or disable "
                                  "cluster_sampling):\n- `sample_packing: True`: packing joins records; set "
                                  "sample_packing: false\n- `stage: dpo`: another stage; set stage: sft")


def test_an_auto_train_batch_size_is_refused_on_cpu_with_several_ranks_only():
    auto = {"train_batch_size": "auto"}
    check_batch_size_not_auto_on_cpu(auto, world_size=1, on_cpu=True, frontend="axolotl")
    check_batch_size_not_auto_on_cpu(auto, world_size=2, on_cpu=False, frontend="axolotl")
    check_batch_size_not_auto_on_cpu({"train_batch_size": 16}, world_size=2, on_cpu=True, frontend="axolotl")
    with pytest.raises(ValueError, match="remove train_batch_size from the JSON"):
        check_batch_size_not_auto_on_cpu(auto, world_size=2, on_cpu=True, frontend="axolotl")


def test_a_bound_trainer_class_passes_its_block_and_the_guard_knows_ds_clusters_trainers():
    from transformers import Trainer

    from ds_cluster.integrations.hf import ClusterSamplingMixin, ClusterTrainer

    class FrontendTrainer(FrontendRowsMixin, ClusterSamplingMixin, Trainer):
        frontend = "a frontend"

    assert bind_block(FrontendTrainer, None) is FrontendTrainer
    bound = bind_block(FrontendTrainer, {"enabled": False})
    assert issubclass(bound, FrontendTrainer) and bound.cluster_block == {"enabled": False}
    assert bound.__name__ == "FrontendTrainer" and FrontendTrainer.cluster_block is None
    require_cluster_trainer(ClusterTrainer.__new__(ClusterTrainer), "axolotl", "why")
    with pytest.raises(RuntimeError, match=r"the trainer is transformers\.trainer\.Trainer, not ds_cluster's \(why\)"):
        require_cluster_trainer(Trainer.__new__(Trainer), "axolotl", "why")


@pytest.mark.integration
def test_a_resume_with_dataloader_workers_trains_with_the_plans_weights_and_normalisers(small_job: Path,
                                                                                         tmp_path: Path):
    """Trainer skips a resumed epoch's first micro-batches through a plain DataLoader of its own, whose worker
    processes copy the dataset when they start: the resumed epoch's weights and "token" loss normalisers must be
    in it by then, or the resumed run trains on another loss (found with axolotl, which starts 1 worker)."""
    from transformers import TrainingArguments

    from ds_cluster.data.dataset import load_instruction_dataset
    from ds_cluster.data.models import load_model_and_tokenizer
    from tests.training import read_trace
    from tests.workers.hf_trainer_worker import TracingClusterTrainer

    block = {"enabled": True, "preset": None, "allocation": "stratified", "num_clusters": 3, "kmeans_n_init": 1,
             "budget_ratio": 0.2, "analysis_path": str(small_job / "analysis")}

    def train(out: Path, resume: str | None) -> list[dict]:
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                 max_steps=4, save_steps=2, use_cpu=True, report_to=[], disable_tqdm=True,
                                 dataloader_num_workers=1, learning_rate=1e-3, lr_scheduler_type="constant", seed=0)
        model, tokenizer = load_model_and_tokenizer(small_job / "model")
        trainer = TracingClusterTrainer(model=model, args=args, cluster_config=block,
                                        train_dataset=load_instruction_dataset(small_job / "train.jsonl", tokenizer,
                                                                               max_length=64))
        trainer.trace_dir = out / "trace"
        trainer.trace_dir.mkdir(parents=True)
        trainer.train(resume_from_checkpoint=resume)
        return read_trace(out, 0)

    whole = train(tmp_path / "whole", None)
    resumed = train(tmp_path / "resumed", str(tmp_path / "whole" / "checkpoint-2"))
    assert [r["indices"] for r in resumed] == [r["indices"] for r in whole[4:]]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole[4:]], abs=1e-5)
