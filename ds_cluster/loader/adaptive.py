"""The adaptive schedule at training time: windows of `adapt_every` optimizer steps whose per-cluster shares follow
what the clusters' losses did in the window before (docs/adaptive.md).

A window is placed like the static plan (`allocation.Stratified`): every rank takes the same count per step and
the clusters are spread over the steps; inside a cluster the samples come from seeded passes over its pool,
without replacement until the pool is used up. When the next window opens, the finished window's figures (the
loader's tally of the per-sample training losses since the window began, and the loss on a small probe set held
out of training) are summed over the data-parallel ranks, so every rank computes the same next shares
(`planning.shares`), and the ranks compare them. With budget_ratio "auto", a cluster that stops improving stops
being drawn (or keeps `auto_maintenance` of its natural share), and when every cluster has stopped the run ends,
or first cools down for `auto_cooldown` of its steps over every cluster at the natural shares (`cooldown_steps`
tells the learning-rate schedule when).

Between windows the schedule keeps one `WindowState` (shares, rule state, streams before the draw, the auto
budget's bookkeeping); the state a checkpoint holds is that, the window's number and the figures of its steps so
far. A resumed run redraws the window from its state and sees the same figures, so it continues with the same
shares, indices and losses.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ds_cluster.collectives import LOCAL, Collectives
from ds_cluster.loader.schedule import Block, RunEnd, Schedule
from ds_cluster.planning.allocation import Stratified, batch_quotas
from ds_cluster.planning.plan import Plan
from ds_cluster.planning.auto import AutoState, auto_step
from ds_cluster.planning.shares import ADAPTIVE_RULES, AdaptiveRule, WindowFigures, window_draws
from ds_cluster.planning.tally import ClusterTally
from ds_cluster.planning.weights import WEIGHTINGS
from ds_cluster.settings import ScheduleSettings

logger = logging.getLogger(__name__)

# probe(sample indices) -> each sample's mean response-token loss (float tensor) under the model being trained,
# forward only.
ProbeLosses = Callable[[Sequence[int]], torch.Tensor]


@dataclass
class WindowState:
    """What a window is drawn from: the shares, the rule's state, each cluster's stream (pass, position) before the
    draw, the auto budget's bookkeeping (`planning.auto.AutoState`: per cluster its stop, best loss, windows
    without improvement, history and stop record), and its cool-down ({"start", "end"} in optimizer steps) once
    announced. Plain JSON in checkpoints."""

    shares: list
    rule_state: dict
    streams: list
    auto: AutoState
    cooldown: Optional[dict] = None

    @classmethod
    def first(cls, shares: np.ndarray, rule: AdaptiveRule) -> "WindowState":
        num_clusters = shares.size
        return cls(shares.tolist(), rule.initial_state(num_clusters), [[0, 0] for _ in range(num_clusters)],
                   AutoState.empty(num_clusters))

    @classmethod
    def from_json(cls, data: dict) -> "WindowState":
        """A state as `to_json` wrote it, or as 0.6.0 did (the auto budget's lists beside the shares; its history,
        first losses and stop records absent before 0.6.0)."""
        if "auto" in data:
            auto = AutoState(**data["auto"])
        else:
            empty = AutoState.empty(len(data["stopped"]))
            auto = AutoState(list(data["best"]), list(data["stale"]), list(data["stopped"]),
                             data.get("history") or empty.history, data.get("first_losses") or empty.first,
                             data.get("stops") or empty.stops)
        return cls(data["shares"], data["rule_state"], data["streams"], auto, data.get("cooldown"))

    def to_json(self) -> dict:
        return {"shares": self.shares, "rule_state": self.rule_state, "streams": self.streams,
                "auto": asdict(self.auto), "cooldown": self.cooldown}


@dataclass(frozen=True)
class _Draw:
    """One window's draw: the samples of each cluster, and the streams after it."""

    members: list
    draws: np.ndarray
    streams_after: list


class AdaptiveSchedule(Schedule):
    """Windows whose shares follow the clusters' losses. `collectives`: this rank among the data-parallel ranks;
    `probe_losses`: the per-sample losses of given samples with the model being trained (forward only, called on
    every rank at the same point; `integrations.setup` builds it from the trainer's model and the loader's data),
    or None for no probe."""

    kind = "adaptive"
    opens_ahead = False

    def __init__(self, plan: Plan, rank: int, settings: ScheduleSettings, *, collectives: Collectives = LOCAL,
                 probe_losses: Optional[ProbeLosses] = None) -> None:
        super().__init__(plan, rank)
        if collectives.world_size != plan.world_size or collectives.rank != rank:
            raise ValueError(f"the adaptive schedule of rank {rank} of {plan.world_size} was given the collectives of "
                             f"rank {collectives.rank} of {collectives.world_size}")
        self.settings = settings
        self.collectives = collectives
        self.probe_losses = probe_losses
        self.rule = ADAPTIVE_RULES.get_rule(settings.rule)
        self.shape = plan.batch_shape
        self.natural = plan.cluster_sizes / plan.cluster_sizes.sum()
        self.probe, self.pools = _probe_and_pools(plan, settings)
        self.state = WindowState.first(_active_shares(self.natural, self._has_pool()), self.rule)
        self.window = -1  # the window drawn last (or restored from a checkpoint); -1 before the first
        self.finished = False  # the auto budget has ended the run
        self._drawn: Optional[_Draw] = None
        self._mark: Optional[np.ndarray] = None  # the tally at the window's start
        self._carried = np.zeros(2 * plan.num_clusters, dtype=np.int64)  # every rank's, from before a checkpoint
        self._log_ready = False  # a fresh run starts the log anew; a resumed one keeps its windows before

    @property
    def micro_batches_per_window(self) -> int:
        return self.settings.adapt_every * self.shape.gradient_accumulation_steps

    def locate(self, micro_batch: int) -> tuple[int, int]:
        return divmod(micro_batch, self.micro_batches_per_window)

    def trainable(self) -> np.ndarray:
        return np.sort(np.concatenate(self.pools)) if self.pools else np.zeros(0, dtype=np.int64)

    def _consumed(self, streams: list) -> np.ndarray:
        """Distinct samples of each cluster drawn up to `streams` (a pool is used up before any sample repeats)."""
        sizes = np.array([pool.size for pool in self.pools])
        drawn = np.array([passes * size + position for (passes, position), size in zip(streams, sizes)])
        return np.minimum(drawn, sizes).astype(np.int64)

    def _run_end(self) -> Optional[RunEnd]:
        """The auto budget's cool-down (when it has one): its fraction of the steps, and its steps once announced."""
        if not (self.settings.auto and self.settings.cooldown > 0):
            return None
        cooldown = self.state.cooldown
        return RunEnd(self.settings.cooldown, None if cooldown is None else (int(cooldown["start"]),
                                                                             int(cooldown["end"])))

    # ------------------------------------------------------------ windows
    def open(self, index: int, tally: ClusterTally) -> Optional[Block]:
        """Collective: close the window before (its figures, the rule, auto stopping, the log line), then draw
        window `index`; None once the run has ended."""
        if self.finished:
            return None
        self._start_log()
        if self._mark is None:
            self._mark = tally.snapshot()
        if 0 <= self.window < index:
            if self._drawn is None:  # a window restored from a checkpoint: its draw gives the streams after it
                self._drawn = self._draw(self.state)
            self.state = self._next_state(self._close(tally))
            if self.finished:
                return None
        self.window = index
        self._drawn = self._draw(self.state)
        quotas = batch_quotas(self._drawn.draws, self.shape.global_batch_size)
        layout = Stratified().rank_layout(self._drawn.members, quotas, self.shape, self.rank)
        per_cluster = WEIGHTINGS.get_rule(self.settings.weighting).cluster_weights(
            self.plan.cluster_sizes, self._drawn.draws.astype(np.float64), self.settings.temperature)
        weights = np.zeros(self.plan.num_samples, dtype=np.float32)
        for cluster, taken in enumerate(self._drawn.members):
            weights[taken] = per_cluster[cluster]
        return Block(index, layout.reshape(-1, self.plan.micro_batch_size), weights,
                     self._consumed(self._drawn.streams_after), tuple(float(share) for share in self.state.shares),
                     self._run_end())

    def _has_pool(self) -> np.ndarray:
        return np.array([pool.size > 0 for pool in self.pools])

    def _draw(self, state: WindowState) -> _Draw:
        draws = window_draws(np.asarray(state.shares, dtype=np.float64),
                             self.settings.adapt_every * self.shape.global_batch_size)
        members, streams = [], [list(stream) for stream in state.streams]
        for cluster, count in enumerate(draws.tolist()):
            taken, streams[cluster] = _draw(self.pools[cluster], self.plan.seed, cluster, streams[cluster], count)
            members.append(taken)
        return _Draw(members, draws, streams)

    def _start_log(self) -> None:
        if self._log_ready:
            return
        self._log_ready = True
        if self.collectives.rank == 0 and self.settings.log_path:
            Path(self.settings.log_path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.settings.log_path).write_text("")

    def _close(self, tally: ClusterTally) -> WindowFigures:
        """Collective: the finished window's figures, summed over the ranks."""
        assert self._mark is not None
        total = np.asarray(self.collectives.sum(tally.since(self._mark)), dtype=np.int64) + self._carried
        self._mark = tally.snapshot()
        self._carried = np.zeros_like(self._carried)
        if int(total[self.plan.num_clusters:].sum()) == 0:
            raise RuntimeError(
                f"the adaptive schedule received no per-sample losses in window {self.window}: use "
                "ds_cluster.weighted_causal_lm_loss for the loss (and engine.backward on what it returns), or hand "
                "each micro-batch's losses over with loader.record_losses(batch['sample_index'], losses)")
        return WindowFigures.of(total, self._probe_figures())

    def _probe_figures(self) -> Optional[np.ndarray]:
        """Collective: the probe set's per-cluster tally (fixed point sums, counts), every rank a share of it."""
        if self.probe.size == 0 or self.probe_losses is None:
            return None
        world, micro = self.collectives.world_size, self.plan.micro_batch_size
        mine = self.probe[self.collectives.rank::world]
        per_rank = -(-self.probe.size // world)
        probe_tally = ClusterTally(self.plan.labels, self.plan.num_clusters)
        for start in range(0, per_rank, micro):  # every rank runs as many forwards (ZeRO-3 gathers in step)
            chunk = mine[start:start + micro]
            real = chunk.size
            chunk = np.concatenate([chunk, np.full(min(micro, per_rank - start) - real, self.probe[0])]).astype(int)
            losses = self.probe_losses(chunk.tolist())
            probe_tally.add(chunk[:real], np.asarray(losses.detach().float().cpu(), dtype=np.float64)[:real])
        return np.asarray(self.collectives.sum(probe_tally.totals), dtype=np.int64)

    def _next_state(self, figures: WindowFigures) -> WindowState:
        """The next window's state: the rule's shares over the clusters still drawn; one log line (rank 0)."""
        state = self.state
        auto, predicted = state.auto, None
        cooldown = state.cooldown
        steps_done = (self.window + 1) * self.settings.adapt_every
        if self.settings.auto and cooldown is None:
            auto, predicted = auto_step(auto, figures.tracked_loss, steps_done, self.settings)
        stopped = np.asarray(auto.stopped, dtype=bool)
        active = self._has_pool() & ~stopped
        shares, rule_state = np.asarray(state.shares, dtype=np.float64), state.rule_state
        if cooldown is not None:  # cooling down: the natural shares, until its end
            self.finished = steps_done >= cooldown["end"]
        elif not active.any() and self.settings.cooldown > 0:
            # Every cluster has stopped: a last stretch over all of them (none forgotten) while the LR decays.
            windows = max(1, math.ceil(self.settings.cooldown * (self.window + 1)))
            cooldown = {"start": steps_done, "end": steps_done + windows * self.settings.adapt_every}
            shares = _active_shares(self.natural, self._has_pool())
        elif not active.any():
            self.finished = True
        else:
            shares, rule_state = self.rule.update(state.rule_state, figures, self.natural, active, self.window + 1,
                                                  self.settings.exploration)
            shares = _with_maintenance(shares, self.natural, self._has_pool() & stopped, self.settings.maintenance)
        if self.finished:
            shares = np.zeros(self.plan.num_clusters)
        digest = hashlib.sha256(np.round(shares, 12).tobytes() + json.dumps(rule_state).encode()).hexdigest()[:16]
        self.collectives.check_agreement((self.window, digest), f"adaptive schedule's shares after window "
                                                                f"{self.window}")
        assert self._drawn is not None
        following = WindowState(shares.tolist(), rule_state, self._drawn.streams_after, auto, cooldown)
        self._log(figures, following, predicted)
        return following

    def _log(self, figures: WindowFigures, following: WindowState, predicted: Optional[list]) -> None:
        if self.collectives.rank != 0 or not self.settings.log_path:
            return
        probe = figures.probe_loss
        assert self._drawn is not None
        consumed = self._consumed(self._drawn.streams_after)
        line = {"window": self.window, "step": (self.window + 1) * self.settings.adapt_every,
                "train_loss": _plain(figures.train_loss), "probe_loss": None if probe is None else _plain(probe),
                "shares": following.shares, "samples_consumed": consumed.tolist(),
                "kept_fraction": float(consumed.sum() / self.plan.num_samples),
                "stopped": np.flatnonzero(following.auto.stopped).tolist(), "finished": self.finished}
        if following.cooldown is not None:
            line["cooldown"] = [following.cooldown["start"], following.cooldown["end"]]
        if self.settings.auto:  # why each stopped cluster stopped, and what the signal predicted this window
            line["stops"] = following.auto.stops
            line["predicted_gain"] = predicted
        with open(self.settings.log_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")

    # ---------------------------------------------------------------- state
    def state_dict(self, tally: ClusterTally) -> dict[str, Any]:
        """Collective (the figures of the window so far are summed over the ranks): call on every rank."""
        since = tally.since(self._mark) if self._mark is not None else np.zeros_like(self._carried)
        carried = np.asarray(self.collectives.sum(since), dtype=np.int64) + self._carried
        return {**super().state_dict(tally), "window": self.window, "origin": self.state.to_json(),
                "carried": carried.tolist(), "finished": self.finished}

    def load_state_dict(self, state: dict[str, Any], tally: ClusterTally) -> None:
        super().load_state_dict(state, tally)
        self.window = int(state["window"])
        self.state = WindowState.from_json(state["origin"])
        self.finished = bool(state["finished"])
        self._carried = np.asarray(state["carried"], dtype=np.int64)
        self._mark = tally.snapshot()
        self._drawn = None  # redrawn from its state when the loader next opens a window (that may be collective)
        self._log_ready = True
        if self.collectives.rank == 0 and self.settings.log_path and Path(self.settings.log_path).exists():
            kept = [line for line in Path(self.settings.log_path).read_text().splitlines()
                    if json.loads(line)["window"] < self.window]
            Path(self.settings.log_path).write_text("".join(line + "\n" for line in kept))


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


def _probe_and_pools(plan: Plan, settings: ScheduleSettings) -> tuple[np.ndarray, list[np.ndarray]]:
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


# ------------------------------------------------------------------ 0.5.0's names
class AdaptiveSettings:
    """0.5.0's settings of the adaptive schedule: `ScheduleSettings`, derived as `config.stages().schedule`."""

    @staticmethod
    def from_config(config: Any) -> ScheduleSettings:
        warnings.warn("AdaptiveSettings.from_config(config) is config.stages().schedule since 0.6.0",
                      DeprecationWarning, stacklevel=2)
        return config.stages().schedule


def AdaptiveDataLoader(dataset: Any, plan: Plan, rank: int, settings: Any, *,  # noqa: N802 (0.5.0's class name)
                       collectives: Collectives = LOCAL, collate_fn: Any = None,
                       probe_losses: Optional[Callable[[Any], torch.Tensor]] = None) -> Any:
    """0.5.0's adaptive loader: now `ClusterDataLoader` with an `AdaptiveSchedule` (docs/changes.md)."""
    from ds_cluster.loader.items import batch_reader
    from ds_cluster.loader.sampler import ClusterDataLoader

    warnings.warn("AdaptiveDataLoader is ClusterDataLoader(dataset, plan, rank, schedule=AdaptiveSchedule(...)) "
                  "since 0.6.0", DeprecationWarning, stacklevel=2)
    probe = None
    if probe_losses is not None:  # 0.5.0's probe scored a batch; the schedule's scores given samples
        read, losses_of = batch_reader(dataset, collate_fn), probe_losses
        probe = lambda indices: losses_of(read(indices))  # noqa: E731
    schedule = AdaptiveSchedule(plan, rank, settings, collectives=collectives, probe_losses=probe)
    return ClusterDataLoader(dataset, plan, rank, schedule=schedule, collate_fn=collate_fn, collectives=collectives)
