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


# The two ends docs/design.md names: only these files may touch DeepSpeed or torch.distributed.
ENDS = {"ds_cluster/integrations/deepspeed.py", "ds_cluster/integrations/hf.py", "ds_cluster/integrations/trl.py",
        "ds_cluster/integrations/plan_setup.py", "ds_cluster/distributed.py", "ds_cluster/features/extract.py",
        "ds_cluster/features/model_info.py", "ds_cluster/features/feature_model.py", "ds_cluster/train.py",
        "ds_cluster/cli/analyze.py", "ds_cluster/cli/train.py"}


def _touches_the_ends(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "deepspeed" or
                                                a.name.startswith("torch.distributed") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module.split(".")[0] == "deepspeed" or node.module.startswith("torch.distributed")
                or (node.module == "torch" and any(a.name == "distributed" for a in node.names))):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "distributed" and \
                isinstance(node.value, ast.Name) and node.value.id == "torch":
            return True
    return False


def test_only_the_two_ends_touch_deepspeed_and_torch_distributed():
    touching = {str(path.relative_to(REPO)) for path in _package_files()
                if not str(path.relative_to(REPO)).startswith("ds_cluster/toy/") and _touches_the_ends(path)}
    assert touching <= ENDS, sorted(touching - ENDS)
    design = (REPO / "docs" / "design.md").read_text()
    for path in ENDS:
        assert path.removeprefix("ds_cluster/") in design, f"docs/design.md does not name {path}"


def test_the_stages_take_their_rank_instead_of_reading_it():
    # Rank and world size come in as a Collectives; the stages never ask the process group.
    for name in ("analysis.py", "features/extract.py", "clustering_sharded.py", "plan.py", "selection.py",
                 "allocation.py", "clustering.py"):
        source = (PACKAGE / name).read_text()
        assert "get_rank(" not in source and "get_world_size(" not in source, name
