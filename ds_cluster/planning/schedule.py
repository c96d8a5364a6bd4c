"""Moved: the adaptive schedule's arithmetic is `ds_cluster.planning.shares` (0.6.0; docs/changes.md)."""
from __future__ import annotations

import warnings

from ds_cluster.planning.shares import (ADAPTIVE_RULES, FIXED_POINT, AdaptiveRule, WindowFigures, auto_stop,  # noqa: F401
                                        to_fixed_point, window_draws)

warnings.warn("ds_cluster.planning.schedule is now ds_cluster.planning.shares", DeprecationWarning, stacklevel=2)
