"""The docs' claims read against the code: public names, the defaults table, the loss formulas."""
from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import ds_cluster
from ds_cluster.config import ClusterSamplingConfig
from ds_cluster.loader.loss import weighted_lm_loss
from tests.planning import plan_of
from ds_cluster.loader.sampler import ClusterDataLoader
from tests.launching import REPO

DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"^({IDENTIFIER}(?:\.{IDENTIFIER})+)(?:\(.*\))?$")
# Packages the docs name that are not this one (`deepspeed.initialize` is DeepSpeed's, not integrations/deepspeed.py).
OTHER_PACKAGES = {"deepspeed", "torch", "transformers", "trl", "datasets", "sklearn", "accelerate", "numpy", "sys",
                  "axolotl", "llamafactory"}
# Modules that import a fine-tuning frontend, which is not installed here (each has an environment of its own,
# launch/frontend_env.sh): the names the docs give of them are read from their source instead.
FRONTEND_MODULES = {"ds_cluster.integrations.axolotl", "ds_cluster.integrations.llamafactory"}


def _backticked(path: Path) -> list[str]:
    """Every `code` span of a doc; of changes.md only the newest version's tables' right column (the names as
    they are now: older sections are history)."""
    text = path.read_text(encoding="utf-8")
    if path.name == "changes.md":
        newest = text.split("\n## ")[1]
        kept = []
        for line in newest.splitlines():
            cells = line.split("|")
            if line.startswith("|") and len(cells) > 3:
                kept.append("|".join(cells[2:]))
        text = "\n".join(kept)
    return re.findall(r"`([^`\n]+)`", text)


def _modules() -> dict[str, str]:
    """Short and full names of every ds_cluster module: {"plan_setup": "ds_cluster.integrations.setup", ...}."""
    found = {"ds_cluster": "ds_cluster"}
    # Shallowest first, the command line's modules last: `plan` is ds_cluster.planning.plan, not ds_cluster.cli.plan.
    infos = sorted(pkgutil.walk_packages(ds_cluster.__path__, prefix="ds_cluster."),
                   key=lambda i: (i.name.count("."), i.name.startswith("ds_cluster.cli.")))
    for info in infos:
        found[info.name] = info.name
        found.setdefault(info.name.rsplit(".", 1)[1], info.name)
        # integrations.hf, features.kinds, cli.train ...
        found.setdefault(".".join(info.name.split(".")[-2:]), info.name)
    return found


def _resolves(dotted: str, modules: dict[str, str]) -> bool:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module_name = modules.get(".".join(parts[:split]))
        if module_name is None:
            continue
        if module_name in FRONTEND_MODULES:
            return _defined_in_source(module_name, parts[split:])
        module = importlib.import_module(module_name)
        # `plan.rank_schedule`: a method of an object of the module's class, as the docs write it of an instance.
        for target in [module] + [value for value in vars(module).values() if isinstance(value, type)]:
            for attribute in parts[split:]:
                if not hasattr(target, attribute):
                    break
                target = getattr(target, attribute)
            else:
                return True
        return False
    return False


def _defined_in_source(module_name: str, attributes: list[str]) -> bool:
    """Whether a module's source defines `attributes` (a top-level name, then names in its class body)."""
    scope = ast.parse((REPO / Path(*module_name.split("."))).with_suffix(".py").read_text()).body
    for attribute in attributes:
        defined = {node.name: node for node in scope if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
        for node in scope:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            defined.update({target.id: node for target in targets if isinstance(target, ast.Name)})
        if attribute not in defined:
            return False
        scope = defined[attribute].body if isinstance(defined[attribute], ast.ClassDef) else []
    return True


def _doc_names() -> list[tuple[str, str]]:
    modules = _modules()
    names = []
    for path in DOCS:
        for span in _backticked(path):
            match = DOTTED.match(span.strip())
            if not match:
                continue
            dotted = match.group(1)
            head = dotted.split(".")[0]
            # Names of this package (ds_cluster.x, or a module's short name such as plan_setup.setup_cluster_loader).
            if head == "ds_cluster" or (head in modules and head not in OTHER_PACKAGES
                                        and not dotted.endswith((".py", ".md", ".json", ".jsonl", ".npy"))):
                names.append((path.name, dotted))
    return names


@pytest.mark.parametrize("doc,name", _doc_names(), ids=lambda value: str(value))
def test_every_public_name_in_the_docs_exists(doc: str, name: str):
    assert _resolves(name, _modules()), f"{doc} names `{name}`, which the code does not have"


def _doc_paths() -> list[tuple[str, str]]:
    paths = []
    for path in DOCS:
        for span in _backticked(path):
            span = span.strip()
            if re.fullmatch(r"(ds_cluster|bench|tests|launch|ds_configs|docs)/[\w./-]*", span) and "*" not in span:
                paths.append((path.name, span))
            elif re.fullmatch(r"test_\w+\.py::\w+\*?", span):
                paths.append((path.name, span))
    return paths


@pytest.mark.parametrize("doc,reference", _doc_paths(), ids=lambda value: str(value))
def test_every_file_and_test_the_docs_name_exists(doc: str, reference: str):
    if "::" in reference:
        file_name, test_name = reference.split("::")
        source = (REPO / "tests" / file_name).read_text()
        assert re.search(rf"def {test_name.rstrip('*')}", source), f"{doc} names {reference}"
    else:
        assert (REPO / reference).exists(), f"{doc} names {reference}, which does not exist"


def _defaults_table() -> dict[str, str]:
    rows = {}
    for line in (REPO / "docs" / "configuration.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("key", "---") and not cells[0].startswith("-"):
            rows[cells[0]] = cells[1]
    return rows


def test_the_defaults_table_is_the_configs_defaults():
    table = _defaults_table()
    fields = ClusterSamplingConfig.model_fields
    assert set(table) == set(fields), "docs/configuration.md's table and ClusterSamplingConfig's keys differ"
    defaults = ClusterSamplingConfig()
    for key, written in table.items():
        assert json.loads(written) == getattr(defaults, key), f"{key}: docs say {written}"


# ------------------------------------------------------------------------------------------ the loss formulas
def _step_losses(reduction: str) -> tuple[float, float]:
    """One optimizer step (1 rank, micro 3, accumulation 2) through the loader: the summed micro-batch losses
    as DeepSpeed would accumulate them (each divided by the accumulation steps), and the docs' formula."""
    rng = np.random.default_rng(0)
    num_samples, length, vocab = 24, 7, 11
    labels = torch.full((num_samples, length), -100)
    for row in range(num_samples):
        start = int(rng.integers(1, length - 1))
        labels[row, start:] = torch.as_tensor(rng.integers(0, vocab, length - start))
    dataset = [{"input_ids": torch.zeros(length, dtype=torch.int64), "labels": labels[row]}
               for row in range(num_samples)]
    config = ClusterSamplingConfig(enabled=True, num_clusters=2, budget_mode="proportional", budget_ratio=0.5,
                                   loss_reduction=reduction)
    plan = plan_of(None, config, world_size=1, micro_batch_size=3, gradient_accumulation_steps=2,
                      labels=np.repeat([0, 1], [16, 8]))
    loader = ClusterDataLoader(dataset, plan, 0)
    logits = {index: torch.as_tensor(rng.normal(size=(length, vocab)), dtype=torch.float32)
              for index in range(num_samples)}
    accumulated, step_items = 0.0, []
    for _micro, batch in zip(range(2), loader):
        batch_logits = torch.stack([logits[int(i)] for i in batch["sample_index"]])
        accumulated += float(weighted_lm_loss(batch_logits, batch["labels"], batch["sample_weight"],
                                              batch.get("loss_normalizer"))) / 2
        step_items += [(int(i), float(w)) for i, w in zip(batch["sample_index"], batch["sample_weight"])]
    sums, counts, means = [], [], []
    for index, weight in step_items:
        token_losses = torch.nn.functional.cross_entropy(logits[index][:-1], labels[index][1:], ignore_index=-100,
                                                         reduction="none")[labels[index][1:] != -100]
        sums.append(weight * float(token_losses.sum()))
        counts.append(token_losses.numel())
        means.append(weight * float(token_losses.mean()))
    # docs/trainer.md and docs/configuration.md: "token" = sum_i w_i (token losses of i) / response tokens of the
    # global batch; "sample" = mean over the micro-batch of w_i loss_i, averaged over the accumulation steps.
    formula = sum(sums) / sum(counts) if reduction == "token" else float(np.mean(means))
    return accumulated, formula


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_the_loss_is_the_formula_the_docs_give(reduction: str):
    accumulated, formula = _step_losses(reduction)
    assert accumulated == pytest.approx(formula, rel=1e-5)
    trainer_doc = (REPO / "docs" / "trainer.md").read_text()
    assert f'"{reduction}"' in trainer_doc and "loss_reduction" in trainer_doc


def test_the_docs_name_the_default_reduction():
    default = ClusterSamplingConfig().loss_reduction
    assert f'"{default}" (the default)' in (REPO / "docs" / "trainer.md").read_text()


# ------------------------------------------------------------------------------------------ the README's figures
FIGURE = re.compile(r"[+-]?\d+\.\d+(?: ± \d+\.\d+)?")


def _gains_rows() -> list[tuple[str, str, list[str]]]:
    """The README's table of what it gains: (row, the results file it cites, its figures)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## What it gains"):]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("| mixture"):
            continue
        cited = re.findall(r"`(bench/results/[\w./-]+\.md)`", line)
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows.append((cells[0], cited[0] if cited else "", [f for cell in cells[2:] for f in FIGURE.findall(cell)]))
    return rows


def test_the_readme_has_one_table_of_gains_with_full_data_at_the_same_steps():
    rows = _gains_rows()
    assert len(rows) >= 4 and {"T0", "FLAN"} <= {word for row, _, _ in rows for word in row.split()}
    header = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| mixture"))
    assert "same steps" in header and "random" in header


@pytest.mark.parametrize("row,cited,figures", _gains_rows(), ids=lambda value: str(value)[:40])
def test_the_readmes_figures_are_those_of_the_results_file_they_cite(row: str, cited: str, figures: list[str]):
    assert cited, f"README row {row!r} cites no results file"
    text = (REPO / cited).read_text()
    heldout = text[text.index("## heldout"):]  # the README's figures are held-out ones
    for figure in figures:
        assert re.search(re.escape(figure) + r"(?!\d)", heldout), f"{row}: {figure} is not in {cited}'s held-out part"


def _allowed_column() -> dict[str, str]:
    rows = {}
    for line in (REPO / "docs" / "configuration.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("key", "---"):
            rows[cells[0]] = cells[2]
    return rows


def test_the_docs_list_the_rules_each_registry_holds():
    """The configuration table's allowed values of a rule key are its registry's names, in its order."""
    from ds_cluster.config import RULE_REGISTRIES

    allowed = _allowed_column()
    for key, registry in RULE_REGISTRIES.items():
        assert [name.strip() for name in allowed[key].split(",")] == list(registry.names), key


# ------------------------------------------------------------------------------------------ one home per figure
# Every benchmark figure lives in docs/results.md; the other pages link to its sections (issue 55). Not held to
# it: docs/changes.md (history: what each version measured then) and the README, whose table is checked against
# its results files above and against docs/results.md below.
INTERVAL = re.compile(r"[+-]?\d+\.\d+ ± \d+\.\d+")
FIGURES_HOME = REPO / "docs" / "results.md"
NOT_HOMES = [path for path in DOCS if path.parent.name == "docs" and path.name not in ("results.md", "changes.md")]
NOT_HOMES.append(REPO / "bench" / "README.md")


@pytest.mark.parametrize("page", NOT_HOMES, ids=lambda path: str(path.relative_to(REPO)))
def test_only_docs_results_holds_interval_figures(page: Path):
    copied = [(number, line.strip()) for number, line in enumerate(page.read_text().splitlines(), 1)
              if INTERVAL.search(line)]
    assert not copied, (f"{page.relative_to(REPO)}:{copied[0][0]} copies a benchmark figure "
                        f"({INTERVAL.search(copied[0][1]).group()}): link to its section of docs/results.md instead")


def _written_in(figure: str, text: str) -> bool:
    """Whether `figure` ("0.019 ± 0.109", "-0.026 ± 0.023") is in `text` with the same sign; docs/results.md
    writes positive differences with a "+"."""
    unsigned = figure.lstrip("+")
    sign = "" if unsigned.startswith("-") else r"\+?"
    return re.search(r"(?<![\d.+-])" + sign + re.escape(unsigned) + r"(?!\d)", text) is not None


def test_the_readmes_figures_have_their_home_in_docs_results():
    home = FIGURES_HOME.read_text()
    figures = INTERVAL.findall((REPO / "README.md").read_text())
    assert figures, "the README's table lost its figures: this test would check nothing"
    missing = [figure for figure in figures if not _written_in(figure, home)]
    assert not missing, f"the README's {missing} are not in docs/results.md, the figures' one home"


def _slugs(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens, a repeat
    numbered -1, -2, ...; lines in fenced code are not headings."""
    slugs, seen, fenced = set(), {}, False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        slugs.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return slugs


def _section_links() -> list[tuple[str, str, str]]:
    links = []
    for page in DOCS + [REPO / "bench" / "README.md"]:
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?#([\w-]+)\)", page.read_text()):
            links.append((str(page.relative_to(REPO)), target or page.name, anchor))
    return links


def test_the_pages_link_to_docs_results_sections():
    assert sum(target.endswith("results.md") for _, target, _ in _section_links()) >= 10


@pytest.mark.parametrize("page,target,anchor", _section_links(), ids=lambda value: str(value)[:50])
def test_every_link_to_a_section_finds_its_heading(page: str, target: str, anchor: str):
    linked = ((REPO / page).parent / target).resolve()
    assert linked.exists(), f"{page} links to {target}, which does not exist"
    assert anchor in _slugs(linked), f"{page} links to {target}#{anchor}, a heading {target} does not have"
