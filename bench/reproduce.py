"""Does a rerun reproduce a results file? Every arm a work folder finished beside the same arm in a results JSON.

    python bench/reproduce.py --work-dir runs/repro_check --results bench/results/real/quality_adaptive_overhead.json

For each arm of the work folder that the results file also holds (same name, same seed): the largest absolute
difference of its per-family answer losses (validation and held-out), and whether its steps, kept count, plan
fingerprint, first losses and learning rates are the same. A refactoring that claims "behaviour unchanged" is
checked this way (bench/results/reproduce_0.6.0.md).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

SAME_FIELDS = ("steps", "num_kept", "plan", "kept_sizes", "first_losses", "learning_rate_at_step")


def compare(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """One arm's rerun against its recorded result: the largest loss difference, and which fields differ."""
    worst = 0.0
    for split in ("validation", "heldout"):
        for family, value in new.get(split, {}).get("loss", {}).items():
            worst = max(worst, abs(value - old[split]["loss"][family]))
    return {"max_loss_difference": worst, "differing": [name for name in SAME_FIELDS if new.get(name) != old.get(name)]}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, required=True, help="the rerun's work folder (its arms/*.json)")
    parser.add_argument("--results", type=Path, required=True, help="a results JSON of bench/quality.py")
    parser.add_argument("--tolerance", type=float, default=1e-7, help="the largest loss difference that reproduces")
    args = parser.parse_args(argv)
    recorded = json.loads(args.results.read_text())["arms"]
    rows, failed = [], False
    for path in sorted((args.work_dir / "arms").glob("*.json")):
        if path.name.endswith(".schedule.jsonl") or path.stem not in recorded:
            continue
        row = compare(json.loads(path.read_text()), recorded[path.stem])
        ok = row["max_loss_difference"] <= args.tolerance and not row["differing"]
        failed |= not ok
        rows.append(f"| {path.stem} | {row['max_loss_difference']:.1e} | {', '.join(row['differing']) or 'none'} | "
                    f"{'yes' if ok else 'NO'} |")
    sys.stdout.write("| arm | largest answer-loss difference | fields that differ | reproduced |\n|---|---|---|---|\n"
                     + "\n".join(rows) + "\n")
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
