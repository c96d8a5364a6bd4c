"""Fixtures shared by the test modules."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.training import make_small_job

# The tests force the CPU explicitly, GPU or not (the library leaves the choice to DeepSpeed): the jobs they
# start get it from tests/launching.py, the processes here from this.
os.environ["DS_ACCELERATOR"] = "cpu"


@pytest.fixture(scope="session")
def small_job(tmp_path_factory) -> Path:
    """A 480-sample slice of the shipped data and a hand-made analysis, built once per test session."""
    return make_small_job(tmp_path_factory.mktemp("small_job"))
