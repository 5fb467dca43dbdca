"""Discrete-event goodput simulator: how much of the wall time a job really trains, per recovery policy.

Pure and deterministic (no ray, no torch; ``random.Random`` seeded per trial): ``meshpilot
simulate`` runs it on the driver or a laptop, and ``sweep`` finds the best checkpoint interval.

What happens to a job of ``replicas`` replica groups (one whole model copy each):

* Unexpected failures arrive as a Poisson process with the job's MTTF. Spot preemption notices
  arrive at their own rate, ``notice_s`` before the node goes away.
* Every ``checkpoint_interval_s`` of training the job stalls ``checkpoint_stall_s`` (copy to host)
  and the checkpoint becomes restorable ``checkpoint_upload_s`` after the stall ends.
* Policies:
  - ``restart``: any failure restarts everything from the last restorable checkpoint: the work
    since then is lost and the job is down ``restart_s`` (a failure meanwhile starts it over).
  - ``shrink``: the failed replica group is dropped in place: the step in flight is redone and
    the job pauses ``inplace_recovery_s``, then trains on fewer replicas (at their share of the
    throughput, same global batch) until a replacement joins after ``replace_s`` (a pause of
    ``grow_s``). With fewer than ``min_replicas`` left it restarts as ``restart`` does.
  - ``drain``: ``shrink``, and a preemption notice drains the node's replica at the next step
    boundary (``drain_s``, nothing lost); a single replica takes an emergency checkpoint first.
    Without the policy a notice is ignored and the node simply fails when it goes.
* Goodput (the effective-training-time ratio) is useful work at full capacity / wall time.

Failures land on GPUs that are in the job, so while shrunk they arrive at the surviving share of
the rate (thinning). The same random stream drives every policy and interval of a trial, so
their differences are not noise.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass, field, replace

POLICIES = ("restart", "shrink", "drain")

# Meta's reliability study (Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning
# Research Clusters", HPCA 2025): mean time to failure 7.9 h for 1,024-GPU jobs, 1.8 h projected
# for 16,384 GPUs.
META_MTTF_HOURS = ((1024, 7.9), (16384, 1.8))
# Llama 3 (The Llama 3 Herd of Models, 2024, section 3.3.4): 419 unexpected interruptions in a
# 54-day snapshot of 405B pre-training on 16,384 H100s; more than 90% effective training time.
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16384


def default_mttf_hours(gpus: int) -> float:
    """Job MTTF from Meta's two published points, scaled per GPU outside them.

    Between 1,024 and 16,384 GPUs the MTTF is interpolated on a log-log line through both
    points; beyond them each GPU keeps the per-GPU failure rate of the nearer point, so the
    job's MTTF scales as 1/N.
    """
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    (small_n, small_h), (large_n, large_h) = META_MTTF_HOURS
    if gpus <= small_n:
        return small_h * small_n / gpus
    if gpus >= large_n:
        return large_h * large_n / gpus
    slope = math.log(large_h / small_h) / math.log(large_n / small_n)
    return small_h * (gpus / small_n) ** slope


def young_daly_interval_s(stall_s: float, mttf_s: float) -> float:
    """Young/Daly's first-order optimum checkpoint interval: sqrt(2·delta·MTTF)."""
    return math.sqrt(2.0 * stall_s * mttf_s)


@dataclass(frozen=True)
class SimulationInputs:
    """One scenario; times in seconds. Every field is a ``meshpilot simulate`` flag."""

    gpus: int
    mttf_s: float
    horizon_s: float
    checkpoint_interval_s: float
    checkpoint_stall_s: float
    restart_s: float
    inplace_recovery_s: float
    drain_s: float
    grow_s: float
    replace_s: float
    checkpoint_upload_s: float = 0.0
    replicas: int = 1
    min_replicas: int = 1
    step_s: float = 10.0
    preemptions_per_day: float = 0.0
    notice_s: float = 120.0

    def problems(self) -> list[str]:
        """Every value that cannot describe a job, as sentences naming the flag."""
        found = []
        positive = {
            "gpus": "--gpus",
            "mttf_s": "--mttf-hours",
            "horizon_s": "--days",
            "checkpoint_interval_s": "--checkpoint-interval-min",
            "step_s": "--step-s",
            "replicas": "--replica-gpus",
            "min_replicas": "--min-replicas",
        }
        for name, flag in positive.items():
            if not getattr(self, name) > 0:
                found.append(f"{flag}: {name}={getattr(self, name)!r} must be > 0")
        non_negative = {
            "checkpoint_stall_s": "--stall-s",
            "restart_s": "--restart-s",
            "inplace_recovery_s": "--inplace-s",
            "drain_s": "--drain-s",
            "grow_s": "--grow-s",
            "replace_s": "--replace-min",
            "checkpoint_upload_s": "--upload-s",
            "preemptions_per_day": "--preemptions-per-day",
            "notice_s": "--notice-s",
        }
        for name, flag in non_negative.items():
            if not getattr(self, name) >= 0:
                found.append(f"{flag}: {name}={getattr(self, name)!r} must be >= 0")
        if not found and self.checkpoint_upload_s > self.checkpoint_interval_s:
            found.append(
                f"--upload-s={self.checkpoint_upload_s:g} exceeds the checkpoint interval "
                f"({self.checkpoint_interval_s:g} s): one upload must finish before the next starts"
            )
        if not found and self.min_replicas > self.replicas:
            found.append(f"--min-replicas={self.min_replicas} exceeds the {self.replicas} replica groups")
        return found


@dataclass(frozen=True)
class SimulationResult:
    """What one run of one policy did over the horizon (times in seconds)."""

    policy: str
    checkpoint_interval_s: float
    goodput: float
    failures: int = 0
    preemptions: int = 0
    restores: int = 0  # restarts from a checkpoint
    lost_work_s: float = 0.0  # work redone (full-capacity seconds)
    paused_s: float = 0.0  # recovering, restarting, draining, growing
    checkpoint_stall_s: float = 0.0
    shrunk_loss_s: float = 0.0  # capacity missing while replicas were gone

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


# ---------------------------------------------------------------------------- events
@dataclass(frozen=True)
class _Arrival:
    time: float
    kind: str  # "failure" or "notice"
    thin: float  # uniform draw: accepted when below the share of GPUs in the job
    partial: float  # uniform draw: how far into its step the failure lands


def _arrivals(inputs: SimulationInputs, seed: int, trial: int) -> list[_Arrival]:
    rng = random.Random(f"meshpilot-simulate:{seed}:{trial}")
    arrivals = []
    for kind, mean_gap in (
        ("failure", inputs.mttf_s),
        ("notice", 86400.0 / inputs.preemptions_per_day if inputs.preemptions_per_day else 0.0),
    ):
        if not mean_gap:
            continue
        time_ = rng.expovariate(1.0 / mean_gap)
        while time_ < inputs.horizon_s:
            arrivals.append(_Arrival(time_, kind, rng.random(), rng.random()))
            time_ += rng.expovariate(1.0 / mean_gap)
    arrivals.sort(key=lambda arrival: arrival.time)
    return arrivals


# ---------------------------------------------------------------------------- one run
@dataclass
class _Run:
    """The job's state between events; ``advance`` moves it through training and checkpoints."""

    inputs: SimulationInputs
    policy: str
    t: float = 0.0
    work: float = 0.0  # useful full-capacity seconds done, committed or not
    committed: float = 0.0  # work a restore returns to
    pending: tuple[float, float] | None = None  # (work snapshot, time it becomes restorable)
    snapshot: float = 0.0
    phase: float = 0.0  # seconds into the checkpoint cycle: [0, interval) training, then the stall
    alive: int = 0
    paused_until: float = 0.0
    restart_until: float = -1.0
    generation: int = 0
    counters: dict[str, float] = field(
        default_factory=lambda: {
            "failures": 0,
            "preemptions": 0,
            "restores": 0,
            "lost_work_s": 0.0,
            "paused_s": 0.0,
            "checkpoint_stall_s": 0.0,
            "shrunk_loss_s": 0.0,
        }
    )

    # ------------------------------------------------------------ time
    def advance(self, until: float) -> None:
        while self.t < until:
            if self.t < self.paused_until:
                step = min(until, self.paused_until) - self.t
                self.counters["paused_s"] += step
                self.t += step
                self._commit_due()
                continue
            self._train(until - self.t)
        self._commit_due()

    def _train(self, duration: float) -> None:
        interval, stall = self.inputs.checkpoint_interval_s, self.inputs.checkpoint_stall_s
        cycle = interval + stall
        rate = self.alive / self.inputs.replicas
        self.counters["shrunk_loss_s"] += (1.0 - rate) * duration
        while duration > 0:
            if self.phase == 0.0 and duration >= cycle:
                # Whole cycles at once: the last two snapshots are all that matter.
                cycles = int(duration // cycle)
                start = self.work
                self._commit_due(force=True)
                if cycles >= 2:
                    self.committed = start + (cycles - 1) * rate * interval
                self.work = start + cycles * rate * interval
                self.t += cycles * cycle
                duration -= cycles * cycle
                self.counters["checkpoint_stall_s"] += cycles * stall
                self.pending = (self.work, self.t + self.inputs.checkpoint_upload_s)
                continue
            if self.phase < interval:
                step = min(duration, interval - self.phase)
                self.work += rate * step
                self.phase = interval if step == interval - self.phase else self.phase + step
                if self.phase == interval:
                    self.snapshot = self.work
            else:
                step = min(duration, cycle - self.phase)
                self.counters["checkpoint_stall_s"] += step
                self.phase = 0.0 if step == cycle - self.phase else self.phase + step
                if self.phase == 0.0:
                    self._commit_due(force=True)
                    self.pending = (self.snapshot, self.t + step + self.inputs.checkpoint_upload_s)
            self.t += step
            duration -= step

    def _commit_due(self, force: bool = False) -> None:
        """Make the pending checkpoint restorable once its upload is done (or a newer one replaces it)."""
        if self.pending is not None and (force or self.pending[1] <= self.t):
            self.committed = self.pending[0]
            self.pending = None

    # ------------------------------------------------------------ events
    def pause(self, seconds: float) -> None:
        self.paused_until = max(self.paused_until, self.t) + seconds

    def restore(self, extra_pause: float = 0.0) -> None:
        """Restart everything from the last restorable checkpoint (all replicas back, spares assumed)."""
        self.counters["restores"] += 1
        self.counters["lost_work_s"] += self.work - self.committed
        self.work = self.committed
        self.pending = None
        self.phase = 0.0
        self.alive = self.inputs.replicas
        self.generation += 1  # replacements under way are no longer needed
        self.paused_until = self.t + extra_pause + self.inputs.restart_s
        self.restart_until = self.paused_until

    def can_lose_replica(self) -> bool:
        """Whether a replica group can be dropped in place (else the job restores from a checkpoint)."""
        return self.t >= self.restart_until and self.alive - 1 >= max(1, self.inputs.min_replicas)

    def partial_step_lost(self, fraction: float) -> None:
        if self.t >= self.paused_until:
            lost = min(self.work - self.committed, fraction * self.inputs.step_s * self.alive / self.inputs.replicas)
            self.work -= lost
            self.counters["lost_work_s"] += lost


def simulate(
    inputs: SimulationInputs, policy: str, *, seed: int = 0, trial: int = 0, arrivals: list[_Arrival] | None = None
) -> SimulationResult:
    """Run one policy over the horizon; the same (seed, trial) gives the same failures."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    problems = inputs.problems()
    if problems:
        raise ValueError("; ".join(problems))
    run = _Run(inputs, policy, alive=inputs.replicas)
    queue: list[tuple[float, int, str, float, float, int]] = []
    order = 0
    for arrival in arrivals if arrivals is not None else _arrivals(inputs, seed, trial):
        queue.append((arrival.time, order, arrival.kind, arrival.thin, arrival.partial, 0))
        order += 1
    heapq.heapify(queue)
    while queue and queue[0][0] < inputs.horizon_s:
        time_, _, kind, thin, partial, generation = heapq.heappop(queue)
        run.advance(time_)
        share = run.alive / inputs.replicas if time_ >= run.restart_until else 1.0
        if kind in ("failure", "notice") and thin >= share:
            continue  # it hit a GPU that is not in the job right now
        if kind == "grow":
            if generation == run.generation and run.alive < inputs.replicas and time_ >= run.restart_until:
                run.alive += 1
                run.pause(inputs.grow_s)
            continue
        if kind == "notice":
            run.counters["preemptions"] += 1
            outcome = _drain(run, inputs) if policy == "drain" else "ignored"
            if outcome == "ignored":  # the node fails when it goes
                heapq.heappush(queue, (time_ + inputs.notice_s, order, "preempted", 0.0, partial, 0))
                order += 1
            elif outcome == "drained":
                heapq.heappush(queue, (time_ + inputs.replace_s, order, "grow", 0.0, 0.0, run.generation))
                order += 1
            continue
        # "failure" or "preempted": the node is gone now.
        run.counters["failures"] += kind == "failure"
        if policy == "restart" or not run.can_lose_replica():
            run.restore()
            continue
        run.partial_step_lost(partial)
        run.alive -= 1
        run.pause(inputs.inplace_recovery_s)
        heapq.heappush(queue, (time_ + inputs.replace_s, order, "grow", 0.0, 0.0, run.generation))
        order += 1
    run.advance(inputs.horizon_s)
    return _result(run, inputs, policy)


def _result(run: _Run, inputs: SimulationInputs, policy: str) -> SimulationResult:
    """What a run that reached the horizon adds up to."""
    counters = run.counters
    return SimulationResult(
        policy=policy,
        checkpoint_interval_s=inputs.checkpoint_interval_s,
        goodput=run.work / inputs.horizon_s,
        failures=int(counters["failures"]),
        preemptions=int(counters["preemptions"]),
        restores=int(counters["restores"]),
        lost_work_s=counters["lost_work_s"],
        paused_s=counters["paused_s"],
        checkpoint_stall_s=counters["checkpoint_stall_s"],
        shrunk_loss_s=counters["shrunk_loss_s"],
    )


def _drain(run: _Run, inputs: SimulationInputs) -> str:
    """Act on a notice: "drained" (a replica left cleanly), "restored" or "ignored" (too late)."""
    if run.t < run.restart_until:
        return "restored"  # restarting anyway: the replacement node comes with the restart
    if run.can_lose_replica():
        if inputs.notice_s < inputs.step_s + inputs.drain_s:
            return "ignored"  # too short to finish the step and leave cleanly
        run.alive -= 1
        run.pause(inputs.drain_s)  # at the next step boundary: nothing is lost
        return "drained"
    if inputs.notice_s < inputs.step_s + inputs.checkpoint_stall_s:
        return "ignored"
    # The last replica: an emergency checkpoint, then a restart that loses nothing.
    run.committed, run.pending = run.work, None
    run.restore(extra_pause=inputs.checkpoint_stall_s)
    return "restored"


# ---------------------------------------------------------------------------- sweep
@dataclass(frozen=True)
class PolicyCurve:
    """Mean results of one policy against the checkpoint interval."""

    policy: str
    results: tuple[SimulationResult, ...]  # one per interval of the grid, means over trials
    at_young_daly: SimulationResult
    at_requested: SimulationResult | None  # at the interval asked for, if any

    @property
    def intervals_s(self) -> tuple[float, ...]:
        return tuple(result.checkpoint_interval_s for result in self.results)

    @property
    def goodput(self) -> tuple[float, ...]:
        return tuple(result.goodput for result in self.results)

    @property
    def best(self) -> SimulationResult:
        return max(self.results, key=lambda result: result.goodput)

    @property
    def best_interval_s(self) -> float:
        return self.best.checkpoint_interval_s

    @property
    def best_goodput(self) -> float:
        return self.best.goodput


@dataclass(frozen=True)
class Sweep:
    inputs: SimulationInputs
    trials: int
    seed: int
    young_daly_s: float
    curves: tuple[PolicyCurve, ...]


def interval_grid(inputs: SimulationInputs, points: int = 24) -> list[float]:
    """Log-spaced checkpoint intervals from 1 minute to 12 hours, plus Young/Daly's."""
    low, high = 60.0, 12 * 3600.0
    grid = [low * (high / low) ** (i / (points - 1)) for i in range(points)]
    return sorted(set(grid) | {young_daly_interval_s(max(inputs.checkpoint_stall_s, 1e-3), inputs.mttf_s)})


def sweep(
    inputs: SimulationInputs,
    *,
    policies: tuple[str, ...] = POLICIES,
    trials: int = 5,
    seed: int = 0,
    intervals: list[float] | None = None,
    requested_interval_s: float | None = None,
) -> Sweep:
    """Goodput of each policy over a grid of checkpoint intervals, averaged over ``trials`` runs."""
    young_daly = young_daly_interval_s(inputs.checkpoint_stall_s, inputs.mttf_s)
    grid = intervals if intervals is not None else interval_grid(inputs)
    streams = [_arrivals(inputs, seed, trial) for trial in range(trials)]
    curves: list[PolicyCurve] = []
    for policy in policies:
        twin = next((c for c in curves if {c.policy, policy} == {"shrink", "drain"}), None)
        if twin is not None and inputs.preemptions_per_day == 0:
            # Without spot notices, draining never happens: the two policies are the same run.
            curves.append(_renamed(twin, policy))
            continue
        curves.append(
            PolicyCurve(
                policy=policy,
                results=tuple(_mean(inputs, policy, interval, streams) for interval in grid),
                at_young_daly=_mean(inputs, policy, max(young_daly, 1e-3), streams),
                at_requested=None
                if requested_interval_s is None
                else _mean(inputs, policy, requested_interval_s, streams),
            )
        )
    return Sweep(inputs, trials, seed, young_daly, tuple(curves))


def _renamed(curve: PolicyCurve, policy: str) -> PolicyCurve:
    return PolicyCurve(
        policy=policy,
        results=tuple(replace(result, policy=policy) for result in curve.results),
        at_young_daly=replace(curve.at_young_daly, policy=policy),
        at_requested=None if curve.at_requested is None else replace(curve.at_requested, policy=policy),
    )


def _mean(inputs: SimulationInputs, policy: str, interval_s: float, streams: list[list[_Arrival]]) -> SimulationResult:
    scenario = replace(inputs, checkpoint_interval_s=interval_s)
    runs = [simulate(scenario, policy, arrivals=stream) for stream in streams]
    count = len(runs)
    return SimulationResult(
        policy=policy,
        checkpoint_interval_s=interval_s,
        goodput=sum(r.goodput for r in runs) / count,
        failures=round(sum(r.failures for r in runs) / count),
        preemptions=round(sum(r.preemptions for r in runs) / count),
        restores=round(sum(r.restores for r in runs) / count),
        lost_work_s=sum(r.lost_work_s for r in runs) / count,
        paused_s=sum(r.paused_s for r in runs) / count,
        checkpoint_stall_s=sum(r.checkpoint_stall_s for r in runs) / count,
        shrunk_loss_s=sum(r.shrunk_loss_s for r in runs) / count,
    )
