"""The targeted instrument's own parts (bench/harness/targets.py): targets, draws by whole example groups with no
leakage, the label oracle, the lexical control and the round-robin they share; the report's rule for the SmolLM2
grid's targets and that grid's declared design."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.harness.targets import (TARGET_FIELD, Target, draw_examples, leakage, lexical_subset, oracle_subset,
                                   pool_mask, round_robin, targets_of)

REPO = Path(__file__).resolve().parents[1]


def _records(family: str, examples: int, per_example: int, start: int = 0) -> list[dict]:
    return [{"instruction": f"{family} question {n} asked way {t}", "input": "", "output": f"{family} answer {n}",
             "family": family, "example_id": f"{family}:{n}"}
            for n in range(start, start + examples) for t in range(per_example)]


def test_every_group_is_a_target_and_pairs_and_transfer_name_groups_of_the_mixture():
    targets = targets_of(["a", "b", "c"], pairs=[("a", "b")], transfer=["c"])
    assert [t.name for t in targets] == ["a", "b", "c", "a+b", "transfer_c"]
    assert [t.single for t in targets] == [True, True, True, False, False]
    with pytest.raises(ValueError, match="two of the mixture's groups"):
        targets_of(["a", "b"], pairs=[("a", "z")])
    with pytest.raises(ValueError, match="transfer target 'z'"):
        targets_of(["a"], transfer=["z"])


def test_a_draw_takes_whole_example_groups_marks_each_record_and_is_seeded():
    validation = _records("a", 20, 3) + _records("b", 20, 2)
    draw = draw_examples(validation, Target("a+b", ("a", "b")), per_group=8, seed=0)
    assert len(draw.examples) == 16
    assert [record[TARGET_FIELD] for record in draw.examples] == ["a"] * 8 + ["b"] * 8
    # Whole example groups, the last one trimmed: 3 + 3 + 2 records of group a's examples, 4 x 2 of b's.
    assert len({r["example_id"] for r in draw.examples if r["family"] == "a"}) == 3
    assert draw.example_groups == {r["example_id"] for r in draw.examples}
    assert draw_examples(validation, Target("a+b", ("a", "b")), 8, seed=0).examples == draw.examples
    assert draw_examples(validation, Target("a+b", ("a", "b")), 8, seed=1).examples != draw.examples
    with pytest.raises(ValueError, match="fewer than twice"):
        draw_examples(validation, Target("a", ("a",)), per_group=40, seed=0)


def test_leakage_counts_shared_example_groups_and_prompts():
    validation, pool, heldout = _records("a", 10, 2), _records("a", 10, 2, start=10), _records("a", 5, 1, start=20)
    draw = draw_examples(validation, Target("a", ("a",)), per_group=4, seed=0)
    assert leakage(draw, pool, heldout) == {"example_groups_in_pool": 0, "example_groups_in_heldout": 0,
                                            "prompts_in_pool": 0, "prompts_in_heldout": 0}
    leaky_pool = pool + [dict(draw.examples[0])]
    assert leakage(draw, leaky_pool, heldout)["example_groups_in_pool"] == 1
    assert leakage(draw, leaky_pool, heldout)["prompts_in_pool"] == 1


def test_the_oracle_fills_the_budget_from_the_target_groups_then_at_random():
    pool = _records("a", 10, 1) + _records("b", 100, 1) + _records("c", 100, 1)
    chosen = oracle_subset(pool, Target("a", ("a",)), budget=30, seed=0)
    families = [pool[i]["family"] for i in chosen]
    assert chosen.size == 30 and families.count("a") == 10  # all of a, then 20 from the rest
    both = oracle_subset(pool, Target("b+c", ("b", "c")), budget=30, seed=0)
    assert sorted({pool[i]["family"] for i in both}) == ["b", "c"]
    assert [pool[i]["family"] for i in both].count("b") == 15
    assert not pool_mask(pool, Target("transfer_a", ("a",), transfer=True))[:10].any()


def test_round_robin_takes_turns_over_examples_and_over_groups():
    # Two examples of group x prefer records 0 then 1, and 2 then 3; group y's one example prefers 4, 5, ...
    similarity = np.array([[9, 8, 0, 0, 0, 0], [0, 0, 9, 8, 0, 0], [0, 0, 0, 0, 9, 8]], dtype=float)
    assert round_robin(similarity, ["x", "x", "y"], 3).tolist() == [0, 2, 4]
    assert round_robin(similarity, ["x", "x", "y"], 5).tolist() == [0, 1, 2, 4, 5]
    # A group with a larger similarity scale cannot crowd the other out: the groups take turns.
    scaled = similarity * np.array([[100], [100], [1]])
    assert set(round_robin(scaled, ["x", "x", "y"], 2).tolist()) == {0, 4}
    blocked = similarity.copy()
    blocked[:, 0] = -np.inf  # not in the pool (a transfer target's group)
    assert 0 not in round_robin(blocked, ["x", "x", "y"], 5).tolist()


def test_the_lexical_control_finds_the_target_groups_records_first():
    pool = _records("alpha", 40, 1) + _records("beta", 40, 1) + _records("gamma", 40, 1)
    validation = _records("beta", 10, 1, start=100)
    draw = draw_examples(validation, Target("beta", ("beta",)), per_group=4, seed=0)
    chosen = lexical_subset(pool, draw, budget=20, allowed=np.ones(len(pool), dtype=bool))
    assert chosen.size == 20 and all(pool[i]["family"] == "beta" for i in chosen)


def test_the_smollm2_targets_are_the_largest_oracle_leads_on_validation():
    from bench.harness.targeted_report import oracle_leads

    def cell(mean):
        return {"vs_random": {"mean": mean, "ci": 0.1, "n": 3}}

    # The oracle's loss minus random's: negative where the oracle leads; a pair and a method other than the
    # oracle never count.
    table = {"label_oracle": {"a": cell(-0.2), "b": cell(-1.5), "c": cell(0.3), "d": cell(-0.9), "a+b": cell(-9.0)},
             "lexical": {"a": cell(-5.0)}}
    leads = oracle_leads(table, ["a", "b", "c", "d", "e"])
    assert list(leads) == ["b", "d", "a", "c"]
    assert leads["b"]["mean"] == 1.5 and leads["c"]["mean"] == -0.3 and leads["b"]["ci"] == 0.1


def test_the_smollm2_targeted_grid_takes_its_declared_design_and_names_its_targets():
    from bench import quality

    declared = json.loads((REPO / "bench" / "candidates.json").read_text())["targeted"]["_smollm2"]
    argv = ["--model", "smollm2", "--data", "bench/real/data/flan_cot", "--target", "aqua,qasc,ecqa",
            "--target-candidates", "hidden_round_robin,lora_round_robin,hidden_small_round_robin"]
    settings = quality.settings_from_args(quality.parse_args(argv), argv)
    # The whole mixture (a draw of 32 does not fit the SmolLM2 instrument's 10% slice), the named targets only.
    assert settings.train_fraction == 1.0 and settings.targeted.only == ("aqua", "qasc", "ecqa")
    assert settings.targeted.candidates["lora_round_robin"] == declared["candidates"]["lora_round_robin"]
    assert settings.targeted.candidates["hidden_small_round_robin"]["source"] == "small"
    with pytest.raises(SystemExit, match="aqua"):  # "each" is every group: the SmolLM2 grid runs the chosen three
        quality.settings_from_args(quality.parse_args(["--model", "smollm2", "--data", "bench/real/data/flan_cot",
                                                       "--target", "each"]), [])
    # The stories260K instrument keeps its own declared candidates, without the SmolLM2 grid's.
    stories = quality.settings_from_args(quality.parse_args(["--target", "each"]), ["--target", "each"])
    assert "lora_round_robin" not in stories.targeted.candidates and stories.train_fraction == 1.0


def test_candidates_are_compared_with_the_first_declared_seed_by_seed(tmp_path):
    from bench.harness.arms import Arm
    from bench.harness.summary import mean_ci
    from bench.harness.targeted_summary import TargetedRun

    for folder in ("targets", "data", "arms"):
        (tmp_path / folder).mkdir()
    targets = [{"name": name, "groups": [name], "transfer": False} for name in ("a", "b")]
    (tmp_path / "targets" / "draws.json").write_text(json.dumps({"targets": targets, "draws": {}}))
    for split in ("validation", "train"):
        (tmp_path / "data" / f"{split}.jsonl").write_text(json.dumps({"family": "a"}) + "\n")
    losses = {("first", "a", 0): 1.0, ("first", "b", 0): 1.0, ("first", "a", 1): 1.0, ("first", "b", 1): 1.0,
              ("second", "a", 0): 0.8, ("second", "b", 0): 0.6, ("second", "a", 1): 0.9, ("second", "b", 1): 0.9,
              ("first", "a", 2): 1.0, ("first", "b", 2): 1.0, ("second", "a", 2): 0.0}  # seed 2: b unfinished
    arms = []
    for (method, target, seed), loss in losses.items():
        arm = Arm(name=f"{method}_{target}_s{seed}", setting=method, method=method, seed=seed, analysis="x",
                  fraction=None, cluster_sampling={}, epochs=1, target=target)
        (tmp_path / "arms" / f"{arm.name}.json").write_text(json.dumps({"heldout": {"loss": {target: loss}}}))
        arms.append(arm)
    run = TargetedRun(tmp_path, arms)
    # Per seed, the mean over the targets of second minus first: -0.3 and -0.1; seed 2 lacks a target.
    paired, expected = run.paired("second", "first", "heldout", ["a", "b"]), mean_ci([-0.3, -0.1])
    assert paired["n"] == 2 and paired["mean"] == pytest.approx(-0.2) and paired["ci"] == pytest.approx(expected["ci"])
    assert run.paired("first", "first", "heldout", ["a", "b"])["mean"] == 0.0
    assert run.paired("third", "first", "heldout", ["a", "b"]) is None
