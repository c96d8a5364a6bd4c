"""An axolotl plugin that gives axolotl a trainer class of its own, as its knowledge-distillation and diffusion
plugins do: listed before ds_cluster's, it wins `get_trainer_cls` (tests/test_axolotl.py; .venv-axolotl only)."""
from __future__ import annotations

from typing import Any

from axolotl.core.trainers.base import AxolotlTrainer
from axolotl.integrations.base import BasePlugin


class RivalTrainerPlugin(BasePlugin):
    """Returns axolotl's own trainer class from `get_trainer_cls`."""

    def get_trainer_cls(self, cfg: Any) -> type:
        return AxolotlTrainer
