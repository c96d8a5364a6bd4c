"""The statistics every quality table reads: a mean with its 95% confidence interval over paired seeds, one
arm's quality on one split, and how a statistic is written."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def mean_ci(values: Sequence[float]) -> dict[str, float]:
    """Mean and the half-width of its 95% confidence interval (Student t over the seeds; nan for one seed)."""
    array = np.asarray(values, dtype=np.float64)
    if array.size < 2:
        return {"mean": float(array.mean()) if array.size else float("nan"), "ci": float("nan"), "n": int(array.size)}
    half = T_975.get(array.size - 1, 1.96) * array.std(ddof=1) / math.sqrt(array.size)
    return {"mean": float(array.mean()), "ci": float(half), "n": int(array.size)}


def quality(result: dict, split: str) -> dict[str, float]:
    """Macro and worst-family answer loss, and exact match over the label families, of one arm on one split."""
    loss, em = result[split]["loss"], result[split].get("exact_match") or {}
    return {"loss_macro": float(np.mean(list(loss.values()))), "loss_worst": float(max(loss.values())),
            "em_macro": float(np.mean(list(em.values()))) if em else float("nan"),
            "em_worst": float(min(em.values())) if em else float("nan")}


def format_stat(stat: Optional[dict], digits: int = 3) -> str:
    """'mean ± ci' of a summary statistic, the mean alone with one seed, '—' where nothing was measured."""
    if stat is None or stat["mean"] != stat["mean"]:
        return "—"
    return f"{stat['mean']:.{digits}f}" if stat["ci"] != stat["ci"] else f"{stat['mean']:.{digits}f} ± {stat['ci']:.{digits}f}"
