"""The shape of the library: the core never imports the toy world, files and functions stay readable."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import REPO

PACKAGE = REPO / "ds_cluster"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
# A longer function says why in its docstring with this phrase.
LONG_REASON = "Long because"
CORE_MODULES = ["ds_cluster", "ds_cluster.plan", "ds_cluster.features", "ds_cluster.features.extract",
                "ds_cluster.features.store", "ds_cluster.clustering", "ds_cluster.selection", "ds_cluster.allocation",
                "ds_cluster.sampler", "ds_cluster.loss", "ds_cluster.distributed", "ds_cluster.analysis",
                "ds_cluster.analysis_dir", "ds_cluster.integrations.deepspeed", "ds_cluster.integrations.hf",
                "ds_cluster.cli", "ds_cluster.train", "ds_cluster.report", "ds_cluster.dataset", "ds_cluster.models"]


def test_importing_the_core_loads_no_toy_module():
    script = ("import importlib, sys\n"
              f"for name in {CORE_MODULES!r}:\n"
              "    importlib.import_module(name)\n"
              "print(sorted(m for m in sys.modules if m.startswith('ds_cluster.toy')))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def _package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _package_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_file_is_over_400_lines(path: Path):
    assert len(path.read_text().splitlines()) <= MAX_FILE_LINES


def test_no_function_is_over_60_lines_without_a_reason():
    long = []
    for path in _package_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and LONG_REASON not in (ast.get_docstring(node) or ""):
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length} lines)")
    assert long == []


def test_no_docstring_cites_a_file_outside_the_repository():
    # Design notes the code cites live in docs/, in the repository.
    for path in _package_files():
        assert "DESIGN.md" not in path.read_text(), path
