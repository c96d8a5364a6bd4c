"""Fixtures shared by the test modules."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.training import make_small_job


@pytest.fixture(scope="session")
def small_job(tmp_path_factory) -> Path:
    """A 480-sample slice of the shipped data and a hand-made analysis, built once per test session."""
    return make_small_job(tmp_path_factory.mktemp("small_job"))
