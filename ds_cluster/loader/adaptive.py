"""Stage 6b, the adaptive schedule at training time: windows of `adapt_every` optimizer steps whose per-cluster
shares follow what the clusters' losses did in the window before (docs/adaptive.md).

A window is placed like the static plan (`allocation.Stratified`): every rank takes the same count per step and
the clusters are spread over the steps; inside a cluster the samples come from seeded passes over its pool,
without replacement until the pool is used up. The window's per-cluster figures (per-sample training losses
handed over by `record_losses`, summed in fixed point, and the loss on a small probe set held out of training)
are all-reduced over the data-parallel ranks when the next window starts, so every rank computes the same next
shares (`planning.schedule`), and the ranks compare them. With budget_ratio "auto", a cluster that stops
improving stops being drawn (or keeps `auto_maintenance` of its natural share), and when every cluster has
stopped the run ends, or first cools down for `auto_cooldown` of its steps over every cluster at the natural
shares (`cooldown_steps` tells the learning-rate schedule when).

The state (`state_dict`) is plain JSON: the window's origin (shares, rule state, streams before its draw) and
the figures of its steps so far, summed over the ranks at save time; a resumed run redraws the window and sees
the same figures, so it continues with the same shares, indices and losses.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from ds_cluster.collectives import Collectives
from ds_cluster.loader.sampler import ClusterDataLoader, loss_arrays, response_token_counts
from ds_cluster.planning.allocation import Stratified, batch_quotas
from ds_cluster.planning.plan import Plan
from ds_cluster.planning.schedule import ADAPTIVE_RULES, WindowFigures, auto_stop, to_fixed_point, window_draws
from ds_cluster.planning.weights import WEIGHTINGS

logger = logging.getLogger(__name__)

# probe_losses(batch) -> each sample's mean response-token loss (float tensor), forward only.
ProbeLosses = Callable[[dict], torch.Tensor]


@dataclass(frozen=True)
class AdaptiveSettings:
    """The `cluster_sampling` keys the adaptive schedule reads (docs/configuration.md)."""

    rule: str
    adapt_every: int
    pool: str  # "all" or "selected"
    probe_size: int
    exploration: float
    auto: bool
    tolerance: float
    patience: int
    weighting: str
    temperature: float
    log_path: Optional[str] = None
    cooldown: float = 0.0
    maintenance: float = 0.0

    @classmethod
    def from_config(cls, config: Any) -> "AdaptiveSettings":
        default_log = str(Path(config.analysis_path).absolute().parent / "schedule.jsonl") \
            if config.analysis_path else None
        return cls(rule=config.adaptive_rule, adapt_every=config.adapt_every, pool=config.adaptive_pool,
                   probe_size=config.probe_size, exploration=config.exploration, auto=config.budget_ratio == "auto",
                   tolerance=config.auto_tolerance, patience=config.auto_patience, weighting=config.weighting,
                   temperature=config.weight_temperature, log_path=config.schedule_log or default_log,
                   cooldown=config.auto_cooldown, maintenance=config.auto_maintenance)


class AdaptiveDataLoader(ClusterDataLoader):
    """A rank's loader whose shares change every window; the same interface as the static ClusterDataLoader.

    `collectives`: this rank among the data-parallel ranks; `probe_losses`: what computes the probe set's
    per-sample losses with the model being trained (forward only, called on every rank at the same point).
    """

    def __init__(self, dataset: Dataset, plan: Plan, rank: int, settings: AdaptiveSettings, *,
                 collectives: Collectives, collate_fn: Optional[Callable] = None,
                 probe_losses: Optional[ProbeLosses] = None):
        super().__init__(dataset, plan, rank, collate_fn=collate_fn, sum_over_ranks=collectives.sum)
        self.settings = settings
        self.collectives = collectives
        self.probe_losses = probe_losses
        self.rule = ADAPTIVE_RULES.get_rule(settings.rule)
        self.shape = plan.batch_shape
        num_clusters = plan.num_clusters
        self.natural = plan.cluster_sizes / plan.cluster_sizes.sum()
        self.probe, self.pools = _probe_and_pools(plan, settings)
        self.dataset.weights = np.zeros(plan.num_samples, dtype=np.float32)
        self._run_micro = 0  # micro-batches handed out in the whole run
        self._placeholders = 0  # batches the Trainer skips itself on resume (never read)
        self._window = -1
        self._window_first_micro = 0
        self._schedule: Optional[np.ndarray] = None
        self._origin = {"shares": _active_shares(self.natural, self._has_pool()).tolist(),
                        "rule_state": self.rule.initial_state(num_clusters),
                        "streams": [[0, 0] for _ in range(num_clusters)], "stopped": [False] * num_clusters,
                        "best": [None] * num_clusters, "stale": [0] * num_clusters}
        self._local = np.zeros(2 * num_clusters, dtype=np.int64)  # this rank's loss sums (fixed point), counts
        self._carried = np.zeros(2 * num_clusters, dtype=np.int64)  # every rank's, from before a checkpoint
        self.finished = False
        self._log_ready = False  # a fresh run starts the log anew; a resumed one keeps its windows before

    # ------------------------------------------------------------ iteration
    @property
    def completed_epochs(self) -> int:
        """As the static loader's; every epoch counts as done once the schedule has ended (auto budget)."""
        return sys.maxsize if self.finished else super().completed_epochs

    def prepare_epoch(self, epoch: int) -> np.ndarray:
        raise TypeError("the adaptive schedule is built window by window while training: iterate the loader "
                        "(or epoch_batches) instead of asking for a whole epoch")

    def start_epoch(self, epoch: int) -> None:
        """The Trainer starts an epoch (its sampler's set_epoch): the next one, or the resumed one again."""
        if self._placeholders and epoch == self.epoch:
            return
        if epoch != self.epoch:
            self.epoch, self.position = int(epoch), 0

    def trainer_resumes(self) -> None:
        """Trainer skips the resumed epoch's first micro-batches itself: hand it as many placeholders first."""
        self._placeholders = self.position

    def trainer_batches(self) -> Iterator[list[int]]:
        return self.epoch_batches()

    def epoch_batches(self) -> Iterator[list[int]]:
        """The sample indices of this rank's micro-batches for the rest of the current epoch, window by window
        (collective at every window start: call on every rank in step)."""
        if self.position >= self.micro_batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        while self._placeholders:
            self._placeholders -= 1
            yield [0] * self.plan.micro_batch_size
        while self.position < self.micro_batches_per_epoch and not self.finished:
            window = self._run_micro // self.shape.gradient_accumulation_steps // self.settings.adapt_every
            if window != self._window or self._schedule is None:
                self._start_window(window)
                if self.finished:
                    return
            indices = self._schedule[self._run_micro - self._window_first_micro].tolist()
            self._run_micro += 1
            self.position += 1
            yield indices

    def __iter__(self) -> Iterator[Any]:
        for indices in self.epoch_batches():
            yield self.collate_fn([self.dataset[index] for index in indices])

    def record_losses(self, sample_index: Any, losses: Any) -> None:
        """Hand over the per-sample losses of one micro-batch (each sample's mean response-token loss): the
        figures the next window's shares come from. `weighted_causal_lm_loss` does it through the hook and the
        Trainers; a training loop with its own loss calls this once per micro-batch."""
        indices, values = loss_arrays(sample_index, losses)
        self.figures.add(indices, values)
        clusters = self.plan.labels[indices]
        num_clusters = self.plan.num_clusters
        np.add.at(self._local, clusters, to_fixed_point(values))
        np.add.at(self._local, num_clusters + clusters, 1)

    def current_shares(self) -> Optional[list[float]]:
        """Each cluster's sampling share in the window being drawn."""
        return [float(share) for share in self._origin["shares"]]

    def cooldown_steps(self) -> Optional[tuple[int, int]]:
        """(first step, end step) of the auto budget's cool-down once every cluster has stopped, else None: what
        `lr_schedules.warmup_stable_decay` reads to take the learning rate to 0 at the run's end."""
        cooldown = self._origin.get("cooldown")
        return None if cooldown is None else (int(cooldown["start"]), int(cooldown["end"]))

    # ------------------------------------------------------------ windows
    def _has_pool(self) -> np.ndarray:
        return np.array([pool.size > 0 for pool in self.pools])

    def _start_window(self, window: int) -> None:
        """Close the window before (its figures, the rule, auto stopping, the log line), then draw this one."""
        if not self._log_ready:
            self._log_ready = True
            if self.collectives.rank == 0 and self.settings.log_path:
                Path(self.settings.log_path).parent.mkdir(parents=True, exist_ok=True)
                Path(self.settings.log_path).write_text("")
        if window > self._window >= 0 and self._schedule is not None:
            self._origin = self._next_origin(self._close_window())
            if self.finished:
                return
        self._window = window
        self._window_first_micro = window * self.settings.adapt_every * self.shape.gradient_accumulation_steps
        shares = np.asarray(self._origin["shares"], dtype=np.float64)
        draws = window_draws(shares, self.settings.adapt_every * self.shape.global_batch_size)
        members, streams = [], [list(stream) for stream in self._origin["streams"]]
        for cluster, count in enumerate(draws.tolist()):
            taken, streams[cluster] = _draw(self.pools[cluster], self.plan.seed, cluster, streams[cluster], count)
            members.append(taken)
        self._streams_after = streams
        quotas = batch_quotas(draws, self.shape.global_batch_size)
        self._schedule = Stratified().rank_layout(members, quotas, self.shape, self.rank).reshape(
            -1, self.plan.micro_batch_size)
        per_cluster = _window_weights(self.settings, self.plan.cluster_sizes, draws)
        weights = np.zeros(self.plan.num_samples, dtype=np.float32)
        for cluster, taken in enumerate(members):
            weights[taken] = per_cluster[cluster]
        self.dataset.weights = weights
        if self.loss_reduction == "token":
            self.dataset.normalizers = self._token_normalizers(self._schedule)

    def _token_normalizers(self, schedule: np.ndarray) -> np.ndarray:
        if self._token_counts is None:
            pool = np.concatenate(self.pools) if self.pools else np.zeros(0, dtype=np.int64)
            self._token_counts = response_token_counts(self.dataset.dataset, np.sort(pool), self.plan.num_samples)
        return super()._token_normalizers(schedule)

    def _close_window(self) -> WindowFigures:
        """Collective: the finished window's figures, summed over the ranks, checked to be the same on all."""
        num_clusters = self.plan.num_clusters
        total = np.asarray(self.collectives.sum(self._local), dtype=np.int64) + self._carried
        self._local[:] = 0
        self._carried[:] = 0
        if int(total[num_clusters:].sum()) == 0:
            raise RuntimeError(
                f"the adaptive schedule received no per-sample losses in window {self._window}: use "
                "ds_cluster.weighted_causal_lm_loss for the loss (and engine.backward on what it returns), or hand "
                "each micro-batch's losses over with loader.record_losses(batch['sample_index'], losses)")
        probe = self._probe_figures()
        return WindowFigures(total[:num_clusters], total[num_clusters:],
                             None if probe is None else probe[:num_clusters],
                             None if probe is None else probe[num_clusters:])

    def _probe_figures(self) -> Optional[np.ndarray]:
        """Collective: the probe set's per-cluster loss sums (fixed point) and counts, every rank a share of it."""
        if self.probe.size == 0 or self.probe_losses is None:
            return None
        num_clusters, world, micro = self.plan.num_clusters, self.collectives.world_size, self.plan.micro_batch_size
        mine = self.probe[self.collectives.rank::world]
        per_rank = -(-self.probe.size // world)
        local = np.zeros(2 * num_clusters, dtype=np.int64)
        for start in range(0, per_rank, micro):  # every rank runs as many forwards (ZeRO-3 gathers in step)
            chunk = mine[start:start + micro]
            real = chunk.size
            chunk = np.concatenate([chunk, np.full(min(micro, per_rank - start) - real, self.probe[0])]).astype(int)
            batch = self.collate_fn([self.dataset[int(index)] for index in chunk])
            losses = np.asarray(self.probe_losses(batch).detach().float().cpu(), dtype=np.float64)[:real]
            clusters = self.plan.labels[chunk[:real]]
            np.add.at(local, clusters, to_fixed_point(losses))
            np.add.at(local, num_clusters + clusters, 1)
        return np.asarray(self.collectives.sum(local), dtype=np.int64)

    def _next_origin(self, figures: WindowFigures) -> dict[str, Any]:
        """The next window's origin: the rule's shares over the clusters still drawn; one log line (rank 0)."""
        origin = self._origin
        stopped = np.asarray(origin["stopped"], dtype=bool)
        best = np.array([np.nan if b is None else b for b in origin["best"]], dtype=np.float64)
        stale = np.asarray(origin["stale"], dtype=np.int64)
        cooldown = origin.get("cooldown")
        steps_done = (self._window + 1) * self.settings.adapt_every
        if self.settings.auto and cooldown is None:
            best, stale, stopped = auto_stop(best, stale, stopped, figures.tracked_loss, self.settings.tolerance,
                                             self.settings.patience)
        active = self._has_pool() & ~stopped
        shares, rule_state = np.asarray(origin["shares"], dtype=np.float64), origin["rule_state"]
        if cooldown is not None:  # cooling down: the natural shares, until its end
            self.finished = steps_done >= cooldown["end"]
        elif not active.any() and self.settings.cooldown > 0:
            # Every cluster has stopped: a last stretch over all of them (none forgotten) while the LR decays.
            windows = max(1, math.ceil(self.settings.cooldown * (self._window + 1)))
            cooldown = {"start": steps_done, "end": steps_done + windows * self.settings.adapt_every}
            shares = _active_shares(self.natural, self._has_pool())
        elif not active.any():
            self.finished = True
        else:
            shares, rule_state = self.rule.update(origin["rule_state"], figures, self.natural, active,
                                                  self._window + 1, self.settings.exploration)
            shares = _with_maintenance(shares, self.natural, self._has_pool() & stopped, self.settings.maintenance)
        if self.finished:
            shares = np.zeros(self.plan.num_clusters)
        digest = hashlib.sha256(np.round(shares, 12).tobytes() + json.dumps(rule_state).encode()).hexdigest()[:16]
        self.collectives.check_agreement((self._window, digest), f"adaptive schedule's shares after window "
                                                                 f"{self._window}")
        self._log(figures, shares, stopped, cooldown)
        return {"shares": shares.tolist(), "rule_state": rule_state, "streams": self._streams_after,
                "stopped": stopped.tolist(), "best": [None if np.isnan(b) else float(b) for b in best],
                "stale": stale.tolist(), "cooldown": cooldown}

    def consumed(self) -> np.ndarray:
        """Distinct samples of each cluster drawn so far (a pool is used up before any sample repeats)."""
        streams = getattr(self, "_streams_after", self._origin["streams"])
        sizes = np.array([pool.size for pool in self.pools])
        drawn = np.array([passes * size + position for (passes, position), size in zip(streams, sizes)])
        return np.minimum(drawn, sizes)

    def _log(self, figures: WindowFigures, shares: np.ndarray, stopped: np.ndarray,
             cooldown: Optional[dict[str, int]]) -> None:
        if self.collectives.rank != 0 or not self.settings.log_path:
            return
        probe = figures.probe_loss
        line = {"window": self._window, "step": (self._window + 1) * self.settings.adapt_every,
                "train_loss": _plain(figures.train_loss), "probe_loss": None if probe is None else _plain(probe),
                "shares": shares.tolist(), "samples_consumed": self.consumed().tolist(),
                "kept_fraction": float(self.consumed().sum() / self.plan.num_samples),
                "stopped": np.flatnonzero(stopped).tolist(), "finished": self.finished}
        if cooldown is not None:
            line["cooldown"] = [cooldown["start"], cooldown["end"]]
        with open(self.settings.log_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")

    # ---------------------------------------------------------------- state
    def state_dict(self, global_step: Optional[int] = None) -> dict[str, Any]:
        """Collective (the figures of the window so far are summed over the ranks): call on every rank."""
        state = super().state_dict(global_step)
        carried = np.asarray(self.collectives.sum(self._local), dtype=np.int64) + self._carried
        state["adaptive"] = {"run_micro": self._run_micro, "window": self._window, "origin": self._origin,
                             "carried": carried.tolist(), "finished": self.finished}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state.get("adaptive")
        if saved is None:
            raise ValueError("the checkpoint's sampler state is a static schedule's, and this run's schedule is "
                             "adaptive: resume with the same cluster_sampling block")
        self._run_micro, self._window = int(saved["run_micro"]), int(saved["window"])
        self._window_first_micro = max(self._window, 0) * self.settings.adapt_every * \
            self.shape.gradient_accumulation_steps
        self._origin, self.finished = saved["origin"], bool(saved["finished"])
        self._carried = np.asarray(saved["carried"], dtype=np.int64)
        self._local[:] = 0
        self._schedule = None  # redrawn from the origin at the next batch (not here: that may be collective)
        self._window -= 1  # so that the next batch starts (redraws) the saved window without closing one
        self._log_ready = True
        if self.collectives.rank == 0 and self.settings.log_path and Path(self.settings.log_path).exists():
            kept = [line for line in Path(self.settings.log_path).read_text().splitlines()
                    if json.loads(line)["window"] < int(saved["window"])]
            Path(self.settings.log_path).write_text("".join(line + "\n" for line in kept))


def _window_weights(settings: AdaptiveSettings, cluster_sizes: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Per-cluster loss weights of a window: the weighting rule on the natural sizes and the window's draws."""
    return WEIGHTINGS.get_rule(settings.weighting).cluster_weights(cluster_sizes, draws.astype(np.float64),
                                                                   settings.temperature)


def _with_maintenance(shares: np.ndarray, natural: np.ndarray, stopped: np.ndarray, maintenance: float
                      ) -> np.ndarray:
    """The active clusters' shares, scaled down so that each stopped cluster keeps `maintenance` x its natural
    share (what it has learned is revisited, not forgotten)."""
    if maintenance <= 0 or not stopped.any():
        return shares
    kept = np.where(stopped, maintenance * natural, 0.0)
    return shares * (1.0 - kept.sum()) + kept


def _plain(values: np.ndarray) -> list:
    return [None if np.isnan(value) else float(value) for value in values]


def _active_shares(natural: np.ndarray, active: np.ndarray) -> np.ndarray:
    shares = np.where(active, natural, 0.0)
    return shares / shares.sum()


def _probe_and_pools(plan: Plan, settings: AdaptiveSettings) -> tuple[np.ndarray, list[np.ndarray]]:
    """The probe set (probe_size of every cluster, seeded, never trained on) and each cluster's training pool
    (its selected samples, or all of its samples), sorted."""
    taking_part = np.flatnonzero(plan.labels >= 0)
    pool = plan.selected if settings.pool == "selected" else taking_part
    rng = np.random.default_rng([plan.seed, 0x9B0BE])
    probe, pools = [], []
    for cluster in range(plan.num_clusters):
        members = taking_part[plan.labels[taking_part] == cluster]
        # A probe never takes a cluster's last training sample.
        count = min(settings.probe_size, max(members.size - 1, 0))
        chosen = np.sort(members[rng.permutation(members.size)[:count]])
        probe.append(chosen)
        own = pool[plan.labels[pool] == cluster]
        pools.append(np.setdiff1d(own, chosen, assume_unique=True))
    return np.concatenate(probe).astype(np.int64), pools


def _draw(pool: np.ndarray, seed: int, cluster: int, stream: list[int], count: int) -> tuple[np.ndarray, list[int]]:
    """`count` samples of a cluster's pool from its stream (pass, position): seeded passes, each a permutation,
    without replacement until the pool is used up."""
    passes, position = stream
    taken = []
    while count > 0 and pool.size:
        order = pool[np.random.default_rng([seed, 0xADA97, cluster, passes]).permutation(pool.size)]
        step = min(count, pool.size - position)
        taken.append(order[position:position + step])
        count -= step
        position += step
        if position == pool.size:
            passes, position = passes + 1, 0
    return (np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)), [passes, position]
