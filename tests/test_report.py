"""The HTML report: coverage counts, PCA, family purity, a self-contained folder, and a real render in Chromium."""
from __future__ import annotations

import html
from dataclasses import replace
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ds_cluster import ClusterSamplingConfig, Plan
from tests.planning import plan_of
from ds_cluster.data.dataset import prompt_text
from ds_cluster.report.clusters import describe_clusters, distinguishing_words
from ds_cluster.report.page import ReportInputs, write_report
from tests.launching import REPO
from ds_cluster.report.summary import (cluster_category_counts, cluster_counts_per_rank_step, pca_projection,
                                       layout_coverage)

FAMILIES = ("add", "sort", "reverse")


@pytest.fixture(scope="module")
def blobs() -> tuple[np.ndarray, list[str]]:
    """300 samples in three separated blobs (one family each, a few strays), the last 5 all-zero (no response)."""
    rng = np.random.default_rng(0)
    centres = rng.normal(0, 6, (3, 8))
    family_ids = np.repeat([0, 1, 2], [150, 90, 60])
    features = (centres[family_ids] + rng.normal(0, 1, (300, 8))).astype(np.float32)
    features[-5:] = 0.0
    families = [FAMILIES[i] for i in family_ids]
    families[0] = "sort"  # a stray: purity just below 1
    return features, families


# Each family's prompts share its own words and the words every family uses ("please", "following").
PROMPT_WORDS = {"add": ("add", "numbers", "sum"), "sort": ("sort", "list", "ascending"),
                "reverse": ("reverse", "string", "backwards")}


def prompts_of(families: list[str]) -> list[str]:
    return [f"Please {PROMPT_WORDS[family][0]} the following {PROMPT_WORDS[family][1]} "
            f"({PROMPT_WORDS[family][2]}), case {index}: item{index % 7}" for index, family in enumerate(families)]


def make_plan(features: np.ndarray, paper: bool = False) -> Plan:
    """3 clusters, proportional budget, stratified allocation; or the paper's K = world, min budget, one cluster a
    rank."""
    config = ClusterSamplingConfig(enabled=True, num_clusters=3, budget_mode="proportional", budget_ratio=0.5,
                                   kmeans_n_init=2)
    if paper:
        config = ClusterSamplingConfig(enabled=True, preset="paper", kmeans_n_init=2, budget_ratio=0.5)
    exclude = ~np.any(features != 0, axis=1)
    return plan_of(features, config, world_size=2, micro_batch_size=4, gradient_accumulation_steps=2,
                      exclude=exclude)


@pytest.fixture(scope="module")
def plan(blobs) -> Plan:
    return make_plan(blobs[0])


def test_counts_per_rank_step_are_the_schedule_counted(plan: Plan):
    counts = cluster_counts_per_rank_step(plan, epoch=0)
    schedule = plan.epoch_layout(0)
    assert counts.shape == (plan.steps_per_epoch, plan.world_size, plan.num_clusters)
    assert (counts.sum(axis=2) == plan.micro_batch_size * plan.gradient_accumulation_steps).all()
    for step in (0, plan.steps_per_epoch - 1):
        for rank in range(plan.world_size):
            expected = np.bincount(plan.labels[schedule[step, rank].ravel()], minlength=plan.num_clusters)
            assert counts[step, rank].tolist() == expected.tolist()


def test_coverage_of_stratified_and_cluster_per_rank_schedules(blobs, plan: Plan):
    stratified = layout_coverage(plan)
    assert stratified["steps"] == plan.steps_per_epoch
    assert stratified["clusters_per_step_min"] == plan.num_clusters  # every cluster in every global step
    per_rank = make_plan(blobs[0], paper=True)
    coverage = layout_coverage(per_rank)
    assert coverage["clusters_per_rank_step_min"] == coverage["clusters_per_rank_step_mean"] == 1


def test_pca_projection_is_deterministic_bounded_and_separates_blobs(blobs, plan: Plan):
    features, _ = blobs
    included = np.flatnonzero(plan.labels >= 0)
    first = pca_projection(features, included, max_points=120, seed=3)
    second = pca_projection(features, included, max_points=120, seed=3)
    for a, b in zip(first, second):
        assert np.array_equal(a, b)
    rows, coords, explained = first
    assert len(rows) == 120 and set(rows) <= set(included.tolist())
    assert coords.shape == (120, 2) and 0.5 < explained.sum() <= 1.0
    # Three separated blobs: on the two main axes each cluster's points sit closer to their own centre.
    labels = plan.labels[rows]
    centres = np.stack([coords[labels == c].mean(axis=0) for c in range(plan.num_clusters)])
    nearest = np.linalg.norm(coords[:, None] - centres[None], axis=2).argmin(axis=1)
    assert (nearest == labels).mean() > 0.95


def test_cluster_category_counts_and_purity():
    labels = np.array([0, 0, 0, 1, 1, -1])
    families = ["a", "a", "b", "b", "b", "c"]
    names, counts, purity = cluster_category_counts(labels, families, num_clusters=2)
    assert names == ["a", "b"]  # "c" is only on a left-out sample
    assert counts.tolist() == [[2, 1], [0, 2]]
    assert purity == pytest.approx(4 / 5)


def image_sources(page: str) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', page)


def test_report_folder_is_self_contained(tmp_path: Path, blobs, plan: Plan):
    features, families = blobs
    index = write_report(tmp_path / "report", plan, ReportInputs(features=features, categories=families, title="t <&>"))
    page = index.read_text()
    sources = image_sources(page)
    assert len(sources) == 5, sources  # sizes, weights, heat map, projection, families
    for source in sources:
        assert "/" not in source and (index.parent / source).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<script" not in page and "http" not in page
    assert "t &lt;&amp;&gt;" in page  # text is escaped
    _, _, purity = cluster_category_counts(plan.labels, families, plan.num_clusters)
    assert purity > 0.95 and f"Purity {purity:.3f}" in page  # blobs are families, bar a stray and the cap


def test_each_cluster_is_described_by_its_own_words_categories_and_central_prompts(blobs, plan: Plan):
    features, families = blobs
    prompts = prompts_of(families)
    descriptions = describe_clusters(plan, prompts=prompts, categories=families)
    assert [d.cluster for d in descriptions] == list(range(plan.num_clusters))
    for d in descriptions:
        members = np.flatnonzero(plan.labels == d.cluster)
        assert (d.size, d.kept) == (len(members), int(np.isin(plan.selected, members).sum()))
        majority = d.categories[0][0]
        assert sum(count for _, count in d.categories) == d.size
        # The words that set a cluster apart are its family's, never the words every family shares.
        assert set(d.words[:3]) == set(PROMPT_WORDS[majority]), (majority, d.words)
        assert not {"please", "following", "case"} & set(d.words)
        # The examples are the members nearest their k-means centre, in that order.
        nearest = members[np.argsort(plan.distances[members], kind="stable")[:3]]
        assert d.examples == [prompts[i] for i in nearest]
    weight_of = {int(plan.labels[i]): float(plan.weights[i]) for i in plan.selected}
    assert [d.weight for d in descriptions] == [weight_of.get(c, 0.0) for c in range(plan.num_clusters)]


def test_without_text_a_cluster_keeps_its_figures_and_loses_its_words_and_prompts(blobs, plan: Plan):
    features, families = blobs
    with_text = describe_clusters(plan, prompts=prompts_of(families), categories=families)
    without = describe_clusters(plan, prompts=None, categories=families)
    assert all(d.words == [] and d.examples == [] for d in without)
    assert [(d.size, d.kept, d.weight, d.categories) for d in without] == \
        [(d.size, d.kept, d.weight, d.categories) for d in with_text]
    with pytest.raises(ValueError, match="prompts has 2 entries but the plan 300 samples"):
        describe_clusters(plan, prompts=["a", "b"])


def test_the_prompt_text_of_every_kind_of_record_is_what_the_user_asked():
    assert prompt_text({"instruction": "Sort", "input": "b a", "output": "a b"}) == "Sort\nb a"
    assert prompt_text({"instruction": "Sort", "input": "", "output": "x"}) == "Sort"
    assert prompt_text({"prompt": "Q: 2+2?", "completion": "4"}) == "Q: 2+2?"
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
                         {"role": "assistant", "content": "Bye"}]}
    assert prompt_text(chat) == "Be brief.\nHi\nHello\nBye"  # every turn before the last assistant turn
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    assert prompt_text(sharegpt) == "Hi"


def test_distinguishing_words_small_exact_case():
    prompts = ["red apple", "red cherry", "blue sky", "blue sea", "green"]
    labels = np.array([0, 0, 1, 1, -1])
    assert distinguishing_words(prompts, labels, 3, num_words=2) == [["red", "apple"], ["blue", "sea"], []]
    assert distinguishing_words(["the", "and"], np.array([0, 1]), 2) == [[], []]  # stop words only


def test_the_page_shows_what_each_cluster_holds_and_no_text_when_told(tmp_path: Path, blobs, plan: Plan):
    features, families = blobs
    prompts = prompts_of(families)
    prompts[0] = "Please add <b>bold</b> & more"  # a record's text is escaped, never markup
    shown = ReportInputs(features=features, categories=families, prompts=prompts)
    page = write_report(tmp_path / "with", plan, shown).read_text()
    assert "What each cluster holds" in page and "ascending" in page and "<b>bold" not in page
    described = describe_clusters(plan, prompts=prompts, categories=families)
    for example in (e for d in described for e in d.examples):
        assert html.escape(example) in page
    hidden = write_report(tmp_path / "without", plan, replace(shown, include_text=False)).read_text()
    assert "--no-text" in hidden and not any(words in hidden for words in ("ascending", "backwards", "Please"))


def test_an_adaptive_runs_log_adds_its_shares_and_losses(tmp_path: Path, plan: Plan):
    lines = [{"window": w, "step": 10 * (w + 1), "train_loss": [2.0 - w / 10, 1.5, None],
              "probe_loss": None if w else [2.1, 1.6, 1.0], "shares": [0.5, 0.3, 0.2],
              "samples_consumed": [20 * (w + 1), 12 * (w + 1), 8 * (w + 1)], "kept_fraction": 0.4 * (w + 1) / 3,
              "stopped": [2] if w == 2 else [], "finished": w == 2} for w in range(3)]
    page = write_report(tmp_path, plan, ReportInputs(schedule_lines=lines)).read_text()
    assert "schedule.png" in image_sources(page) and (tmp_path / "schedule.png").stat().st_size > 0
    assert "3 windows closed, up to optimizer step 30; samples consumed 120 of 300" in page
    assert "clusters stopped: 2; the run finished" in page
    assert "Adaptive schedule" not in write_report(tmp_path / "static", plan).read_text()


def test_an_auto_budgets_log_says_per_cluster_when_it_stopped_why_and_what_it_gained_after(tmp_path: Path,
                                                                                          plan: Plan):
    """With budget_ratio "auto" the log's stop records (planning/auto.py) become the table's stopped step, reason,
    predicted gain and realized gain (the loss at the stop minus the cluster's last loss in the log)."""
    stop = {"step": 20, "signal": "curve", "loss": 1.2, "predicted_gain": 0.05,
            "why": "its learning curve predicts 4.2% lower loss after as many steps again (the bar: 20%), 2 windows "
                   "in a row"}
    lines = [{"window": w, "step": 10 * (w + 1), "train_loss": [2.0 - w / 10, 1.2 - w / 100, 0.9], "probe_loss": None,
              "shares": [0.5, 0.3, 0.2], "samples_consumed": [20 * (w + 1), 12 * (w + 1), 8 * (w + 1)],
              "kept_fraction": 0.4 * (w + 1) / 3, "stopped": [1] if w >= 1 else [], "finished": False,
              "stops": [None, stop if w >= 1 else None, None], "predicted_gain": [0.2, 0.05, None]}
             for w in range(4)]
    page = html.unescape(write_report(tmp_path, plan, ReportInputs(schedule_lines=lines)).read_text())
    table = page.split("Adaptive schedule", 1)[1].split("</table>", 1)[0]
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]]
    cells = rows[1]  # cluster, consumed, of its size, stopped at step, why, predicted, realized, share, loss
    assert cells[3] == "20" and cells[4].startswith("curve: its learning curve predicts 4.2% lower loss")
    assert cells[5] == "0.0500" and cells[6] == "+0.0300"  # 1.2 at the stop, 1.17 in the last window
    assert rows[0][3] == rows[0][4] == ""  # cluster 0 never stopped


def test_report_without_features_or_families_says_so(tmp_path: Path, plan: Plan):
    page = write_report(tmp_path, plan).read_text()
    assert len(image_sources(page)) == 3
    assert "no projection" in page and "no cluster-versus-category table" in page


# --------------------------------------------------------------------------- a real browser
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000"]
# Written into a copy of the page (the report itself has no script): collects load errors from the
# start, and on load writes every image's naturalWidth into the DOM for --dump-dom to show.
PROBE_SCRIPT = """<script>
window.__errors = [];
window.addEventListener("error", function (e) {
  window.__errors.push(String((e.target && e.target.src) || e.message));
}, true);
window.addEventListener("load", function () {
  var probe = document.createElement("pre");
  probe.id = "probe";
  probe.textContent = JSON.stringify({errors: window.__errors, images: Array.prototype.map.call(
    document.images, function (img) { return [img.getAttribute("src"), img.naturalWidth]; })});
  document.body.appendChild(probe);
});
</script>"""


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, installed with apt-get when missing (root only); skip when it cannot be had."""
    found = shutil.which("chromium")
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("chromium is not installed and apt-get is unavailable (or not root) to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True, timeout=300, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"], check=True,
                       capture_output=True, timeout=600, env=env)
    except (subprocess.SubprocessError, OSError) as err:
        pytest.skip(f"chromium could not be installed with apt-get: {err}")
    found = shutil.which("chromium")
    if not found:
        pytest.skip("apt-get ran but no chromium on PATH")
    return found


def run_chromium(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)


def console_messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.browser
def test_report_renders_in_headless_chromium(chromium: str, tmp_path: Path, blobs, plan: Plan):
    features, families = blobs
    index = write_report(tmp_path / "report", plan,
                         ReportInputs(features=features, categories=families, prompts=prompts_of(families)))
    page = index.read_text()
    probe = index.parent / "probe.html"
    probe.write_text(page.replace("<head>", "<head>\n" + PROBE_SCRIPT, 1))

    dumped = run_chromium(chromium, tmp_path / "profile", "--dump-dom", probe.as_uri())
    assert dumped.returncode == 0, dumped.stderr[-3000:]
    match = re.search(r'<pre id="probe">(.*?)</pre>', dumped.stdout, re.S)
    assert match, f"the probe did not run: {dumped.stdout[-2000:]}"
    result = json.loads(html.unescape(match.group(1)))
    assert result["errors"] == []
    assert sorted(src for src, _ in result["images"]) == sorted(image_sources(page))
    assert all(width > 0 for _, width in result["images"]), result["images"]
    assert console_messages(dumped.stderr) == []
    # What each cluster holds reached the rendered page: the section, its words and its example prompts.
    rendered = html.unescape(re.sub(r"<[^>]+>", " ", dumped.stdout))
    assert "What each cluster holds" in rendered and "backwards" in rendered
    assert re.search(r"Please reverse the following string \(backwards\), case \d+", rendered)

    screenshot = tmp_path / "screenshot.png"
    shot = run_chromium(chromium, tmp_path / "profile", "--window-size=1200,2400", f"--screenshot={screenshot}",
                        index.as_uri())
    assert shot.returncode == 0, shot.stderr[-3000:]
    assert console_messages(shot.stderr) == []
    header = screenshot.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(header[16:20], "big") == 1200  # PNG width from the IHDR chunk


def _rendered_cluster_rows(dom: str) -> list[dict]:
    """The rows of "What each cluster holds" as the browser rendered them: cluster, categories, words, examples."""
    section = dom.split("What each cluster holds", 1)[1].split("</table>", 1)[0]
    rows = []
    for row in re.findall(r"<tr>(.*?)</tr>", section, re.S)[1:]:
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
        rows.append({"cluster": int(cells[0]), "categories": html.unescape(cells[4]).strip(),
                     "words": html.unescape(cells[5]).strip(),
                     "examples": [html.unescape(item) for item in re.findall(r"<li>(.*?)</li>", cells[6], re.S)]})
    return rows


@pytest.mark.browser
@pytest.mark.integration
def test_the_report_of_an_analysis_made_in_a_training_job_shows_what_each_cluster_holds(chromium: str, tmp_path: Path,
                                                                                     job_made_analysis: Path):
    """The demo's report (launch/demo.sh: `ds-cluster report` without --data, of the analysis its training job made):
    the records are read from where the analysis says they came from, and every cluster's distinguishing words,
    three example prompts and task-group mix reach the page Chromium renders; --no-text still leaves the text out."""
    from ds_cluster.cli import main

    config = str(REPO / "ds_configs" / "recommended.json")
    assert main(["report", "--analysis", str(job_made_analysis), "--deepspeed", config, "--world-size", "2",
                 "--out", str(tmp_path / "report")]) == 0
    dumped = run_chromium(chromium, tmp_path / "profile", "--dump-dom", (tmp_path / "report" / "index.html").as_uri())
    assert dumped.returncode == 0, dumped.stderr[-3000:]
    rows = _rendered_cluster_rows(dumped.stdout)
    assert [row["cluster"] for row in rows] == list(range(8))  # the recommended preset's 8 clusters
    for row in rows:
        assert row["words"] and len(row["examples"]) == 3 and all(row["examples"]), row
        assert re.match(r"[a-z_]+ \d+", row["categories"]), row  # "family count, ...": the task-group mix
    assert "Purity" in dumped.stdout and "No records" not in dumped.stdout

    assert main(["report", "--analysis", str(job_made_analysis), "--deepspeed", config, "--world-size", "2",
                 "--out", str(tmp_path / "hidden"), "--no-text"]) == 0
    hidden = (tmp_path / "hidden" / "index.html").read_text()
    assert "left out of this report (--no-text)" in hidden and not any(
        html.escape(example[:30]) in hidden for row in rows for example in row["examples"])
