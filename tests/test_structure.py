"""The shape of the library: the wheel is the library, folders are floors in pipeline order, imports point down,
no import circle (bench included), files and functions stay readable."""
from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.launching import REPO

PACKAGE = REPO / "ds_cluster"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
# A longer function says why in its docstring with this phrase.
LONG_REASON = "Long because"
# The floors, lowest first (docs/design.md): a module imports only its own floor and the floors below it.
FLOORS = [
    ("ds_cluster.registry", "ds_cluster.fileio", "ds_cluster.collectives", "ds_cluster.ds_config",
     "ds_cluster.batching", "ds_cluster.distributed", "ds_cluster.settings", "ds_cluster.phases"),
    ("ds_cluster.data",),
    ("ds_cluster.features",),
    ("ds_cluster.clustering",),
    ("ds_cluster.analysis",),
    ("ds_cluster.planning",),
    ("ds_cluster.config",),
    ("ds_cluster.loader",),
    ("ds_cluster.report",),
    ("ds_cluster.integrations",),
    ("ds_cluster.cli", "ds_cluster.train", "ds_cluster.evaluate", "ds_cluster"),
]
MAX_DATA_FILE_BYTES = 100_000


def _package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor(module: str) -> int:
    for level, prefixes in enumerate(FLOORS):
        if any(module == prefix or (prefix != "ds_cluster" and module.startswith(prefix + ".")) for prefix in prefixes):
            return level
    raise AssertionError(f"{module} is on no floor: add it to FLOORS and docs/design.md")


def _runtime_imports(path: Path, package: str) -> set[str]:
    """Modules of `package` imported by `path` when it runs (anywhere in it; `if TYPE_CHECKING:` blocks left out)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skipped.update(id(child) for child in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == package)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
            found.add(node.module)
            # `from ds_cluster.x import y` where y is a module of its own.
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if (REPO / Path(*node.module.split("."), f"{alias.name}.py")).exists()
                         or (REPO / Path(*node.module.split("."), alias.name)).is_dir())
    return found


def _graph(package: str) -> dict[str, set[str]]:
    files = sorted((REPO / package).rglob("*.py"))
    modules = {_module_name(path): path for path in files}
    return {name: {imported for imported in _runtime_imports(path, package) if imported in modules and imported != name}
            for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of `graph` (module -> modules it imports), or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_every_import_in_the_package_points_down_the_floors():
    upward = []
    for path in _package_files():
        name = _module_name(path)
        for imported in _runtime_imports(path, "ds_cluster"):
            if imported != "ds_cluster" and _floor(imported) > _floor(name):
                upward.append(f"{name} (floor {_floor(name)}) imports {imported} (floor {_floor(imported)})")
    assert upward == []


@pytest.mark.parametrize("package", ["ds_cluster", "bench", "tests"])
def test_no_import_circle(package):
    assert _cycle(_graph(package)) == []


def test_the_floors_are_the_folders_docs_design_names():
    design = (REPO / "docs" / "design.md").read_text()
    for folder in sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        assert f"{folder}/" in design, f"docs/design.md does not describe ds_cluster/{folder}/"
    for path in _package_files():
        _floor(_module_name(path))  # every module is on a floor


# The modules that import an optional package the library does not need: TRL, or a fine-tuning frontend (each in an
# environment of its own, launch/frontend_env.sh).
OPTIONAL_MODULES = ("ds_cluster.integrations.trl", "ds_cluster.integrations.axolotl",
                    "ds_cluster.integrations.llamafactory")


def test_the_library_imports_no_benchmark_test_trl_or_plotting_module():
    modules = [_module_name(path) for path in _package_files()
               if _module_name(path) not in (*OPTIONAL_MODULES, "ds_cluster.cli.__main__")]
    script = ("import importlib, sys\n"
              f"for name in {modules!r}:\n"
              "    importlib.import_module(name)\n"
              "import ds_cluster\n"
              "ds_cluster.ClusterTrainer, ds_cluster.install, ds_cluster.build_plan\n"
              "print(sorted({m.split('.')[0] for m in sys.modules} & {'bench', 'tests', 'trl', 'matplotlib', "
              "'axolotl', 'llamafactory'}))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO / "docs", capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_the_wheel_holds_the_library_only(tmp_path):
    """A wheel built from the checkout: only ds_cluster's modules, no data file over 100 kB, nothing of bench/."""
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    wheel = next(tmp_path.glob("ds_cluster-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        entries = [(info.filename, info.file_size) for info in archive.infolist()]
    package_files = [name for name, _ in entries if not name.split("/")[0].endswith(".dist-info")]
    assert package_files and all(name.startswith("ds_cluster/") for name in package_files), package_files
    assert not [name for name in package_files if not name.endswith(".py")], "data files in the wheel"
    assert [name for name, size in entries if size > MAX_DATA_FILE_BYTES and not name.endswith(".py")] == []
    assert not any("/bench/" in name or "/toy/" in name or "/real/" in name for name in package_files)


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
        "ds_cluster/integrations/setup.py", "ds_cluster/distributed.py", "ds_cluster/features/extract.py",
        "ds_cluster/features/model_info.py", "ds_cluster/features/source.py", "ds_cluster/train.py",
        "ds_cluster/cli/analyze.py", "ds_cluster/cli/train.py", "ds_cluster/integrations/saving.py"}


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
    touching = {str(path.relative_to(REPO)) for path in _package_files() if _touches_the_ends(path)}
    assert touching <= ENDS, sorted(touching - ENDS)
    design = (REPO / "docs" / "design.md").read_text()
    for path in ENDS:
        assert path.removeprefix("ds_cluster/") in design, f"docs/design.md does not name {path}"


def test_the_stages_take_their_rank_instead_of_reading_it():
    # Rank and world size come in as a Collectives; the stages and the set-up never ask the process group.
    for name in ("analysis/compute.py", "features/extract.py", "clustering/sharded.py", "clustering/kmeans.py",
                 "planning/plan.py", "planning/selection.py", "planning/allocation.py", "integrations/setup.py"):
        source = (PACKAGE / name).read_text()
        assert "get_rank(" not in source and "get_world_size(" not in source, name


def test_no_rule_is_compared_by_its_name_outside_its_registry():
    """Rules are objects: the stages ask them, never compare a config value with a rule's name."""
    from ds_cluster.config import RULE_REGISTRIES

    owners = {"features/kinds.py", "clustering/kmeans.py", "planning/budget.py", "planning/selection.py",
              "planning/weights.py", "planning/allocation.py", "config.py"}
    names = {name for registry in RULE_REGISTRIES.values() for name in registry}
    compared = []
    for path in _package_files():
        if str(path.relative_to(PACKAGE)) in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = [part for part in [node.left, *node.comparators]
                             if isinstance(part, ast.Constant) and part.value in names]
                containers = [part for part in node.comparators if isinstance(part, (ast.Tuple, ast.List, ast.Set))
                              and any(isinstance(e, ast.Constant) and e.value in names for e in part.elts)]
                if constants or containers:
                    compared.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert compared == []


# The loader's classes, and the attributes callers probed before there was one loader (0.5.0).
LOADER_CLASSES = {"ClusterDataLoader", "AdaptiveDataLoader", "Schedule", "StaticSchedule", "AdaptiveSchedule"}
LOADER_PROBES = {"finished", "consumed", "cooldown_steps", "current_shares", "epoch_batches", "prepare_epoch",
                 "trainer_batches", "schedule", "probe", "pools"}


def test_no_caller_asks_which_loader_or_schedule_it_has():
    """One loader with two schedules: outside ds_cluster/loader/ nothing tests a loader's class, or probes it for
    what only one schedule had."""
    found = []
    for path in _package_files() + sorted((REPO / "bench").rglob("*.py")):
        if path.is_relative_to(PACKAGE / "loader"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id == "isinstance" and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                names = {getattr(kind, "id", getattr(kind, "attr", None)) for kind in kinds}
                if names & LOADER_CLASSES:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} isinstance")
            if node.func.id in ("hasattr", "getattr") and len(node.args) >= 2 and \
                    isinstance(node.args[1], ast.Constant) and node.args[1].value in LOADER_PROBES:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.func.id}({node.args[1].value!r})")
    assert found == []


# The settings types each floor below the config may import (ds_cluster/settings.py): a stage reads its own.
STAGE_SETTINGS = {
    "ds_cluster.features": {"FeatureSettings"},
    "ds_cluster.clustering": {"ClusteringSettings", "stages_of"},
    "ds_cluster.analysis": {"FeatureSettings", "ClusteringSettings", "stages_of"},
    # The plan reads the selection settings (clustering is the floor below's); the auto budget, the schedule's.
    "ds_cluster.planning": {"StageSettings", "stages_of", "ScheduleSettings"},
    "ds_cluster.loader": {"ScheduleSettings", "LossSettings"},
}


def test_each_stage_imports_only_its_own_settings():
    imported = []
    for path in _package_files():
        module = _module_name(path)
        floor = next((prefix for prefix in STAGE_SETTINGS if module.startswith(prefix + ".")), None)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "ds_cluster.settings":
                names = {alias.name for alias in node.names}
                allowed = STAGE_SETTINGS.get(floor, set()) if floor else names
                if names - allowed:
                    imported.append(f"{module} imports {sorted(names - allowed)}")
    assert imported == []


def test_every_key_of_the_block_reaches_a_stage_and_the_plans_fingerprint():
    """A key no stage declares would reach no code, and would be missing from the fingerprint."""
    from ds_cluster.config import NOT_STAGE_KEYS, ClusterSamplingConfig
    from ds_cluster.settings import StageSettings

    assert set(ClusterSamplingConfig.model_fields) - set(NOT_STAGE_KEYS) == StageSettings.declared_keys()


def test_the_library_calls_none_of_its_own_deprecated_names():
    """A function or method that warns DeprecationWarning is there for users' old code; the library's own code calls
    its replacement (a warning raised from ds_cluster also fails the suite: pytest.ini)."""
    deprecated: set[str] = set()
    trees = {path: ast.parse(path.read_text()) for path in _package_files()}
    for tree in trees.values():
        for node in ast.walk(tree):
            # Deprecated: it warns whenever it is called (a statement of its own body, not a branch's).
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
                    and any(isinstance(arg, ast.Name) and arg.id == "DeprecationWarning"
                            for arg in statement.value.args)
                    for statement in node.body):
                deprecated.add(node.name)
    assert {"schedule", "rank_schedule", "epoch_schedule", "schedule_coverage"} <= deprecated
    calls = []
    for path, tree in trees.items():
        for outer in ast.walk(tree):
            if not isinstance(outer, ast.FunctionDef) or outer.name in deprecated:
                continue
            for node in ast.walk(outer):
                if isinstance(node, ast.Call):
                    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                    if name in deprecated:
                        calls.append(f"{_module_name(path)}.{outer.name} calls {name}() (line {node.lineno})")
    assert calls == []
