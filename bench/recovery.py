"""Recovery benchmark: meshpilot's in-place recovery vs Ray Train V2 restarting the same job.

    python bench/recovery.py            # every scenario 3 times, medians reported (~20-25 min on 2 cores)
    python bench/recovery.py --quick    # every scenario once, Ray Train's lost node left out (~5 min)
    python bench/recovery.py --keep DIR # also keep every run's events, logs and the reference's records

One Ray cluster (``ray.cluster_utils.Cluster``: a head node plus worker nodes that offer the
custom resource ``faultnode``, one replica group of 2 ranks per node) and one job: the demo
model (debug preset) on the sample text, 4 ranks as dp_replicate=2 x dp_shard=2 (FSDP2), gloo
on CPU, global batch 16, seq_len 64. Measured, side by side:

1. meshpilot, SIGKILL of rank 3 at the start of step S: from the kill to the completion of the
   first step on the smaller mesh, and completed steps lost. The kill time is when the driver
   last saw the process alive (it polls /proc every 5 ms); the end is that step's
   ``completed_at`` (its slowest rank). The controller's own ``mttr_s`` (from detection) too.
2. meshpilot, the node of replica group 1 removed (``Cluster.remove_node``) once step S completed:
   from the removal call to the first step on the smaller mesh, and steps lost.
3. meshpilot, a Ray drain notice for that node at the start of step S: steps lost and the pause
   (from the last step completed on the old mesh to the first on the smaller one).
4. meshpilot, grow: right after the shrink of (2) a node is added; from the node being up to
   the first step on the grown mesh, and the ``grow`` event's ``join_s`` (the pause itself).
5. One replica (dp_replicate=1 x dp_shard=4 over the two worker nodes), defaults, SIGKILL of
   rank 3 at the start of step ONE_REPLICA_FAULT_STEP (late enough for the snapshot cadence to
   have settled), no spare: meshpilot restoring from peer memory (every rank snapshots its state
   to host memory after each step, the copy overlapping the next step, and a rank of the other
   node keeps a copy; the job goes on at once on dp_shard=2), beside meshpilot with snapshots off
   restoring its newest checkpoint from S3 (a local SeaweedFS, a checkpoint every
   CHECKPOINT_EVERY steps like the reference's): fault to first step and steps lost. Ray Train
   has no replica groups: its figure is (6)'s (a).
   Also the snapshots' cost (``--only snapshot_cost``): uninterrupted one-replica runs with
   snapshots on and off alternating (off, on, on, off), the median pace of each (the time
   between the slowest rank's completions of consecutive steps, which counts every wait the
   snapshots cause, inside the step or between steps) and their ratio; the median time the loop
   waited for a snapshot before an update, the interval the cadence ended with, and the host
   memory per rank.
6. The reference: Ray Train V2's ``TorchTrainer`` (``bench/support/recovery_reference.py``) on the same
   model, FSDP2 layout, data and world size, checkpointing every few steps: (a) a worker
   SIGKILLs itself at the start of step S; (b) the node of a worker is removed (a spare node
   stands by, since Ray Train restarts the whole group at full size).

Both sides keep their default timeouts. For Ray Train that includes waiting up to
TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S (30 s) for surviving workers blocked in a gloo collective
with the dead one before it starts the new group; meshpilot's survivors leave the generation
instead. The reference's steps lost depend on where the fault falls between its checkpoints
(every CHECKPOINT_EVERY steps, fault at FAULT_STEP) and on whether Ray Train had registered the
last one (its controller polls every 2 s).

Every figure runs from the fault to the slowest rank completing the first step afterwards;
"steps lost" are steps completed before the fault that had to be done again. The last stdout
line is one JSON object with each figure, its reference and their ratio; the figures the
goodput simulator reads are recorded in bench/results/latest.json.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, emit  # noqa: E402
from bench.support.recovery_timing import (  # noqa: E402
    MeshChange,
    median,
    mesh_change,
    of_kind,
    ratio,
    restart_from_records,
    step_completed_at,
    table,
)
from tests.fixtures.worker_nodes import NODE_RESOURCE, WorkerNodes  # noqa: E402

BENCH = "bench/recovery.py"
DEMO_CONFIG = REPO / "configs" / "tiny-3d.yaml"
MESH = {"dp_replicate": 2, "dp_shard": 2, "tp": 1, "pp": 1}
WORLD_SIZE = 4
SEQ_LEN = 64
LAYOUT = (
    *(f"parallelism.{name}={degree}" for name, degree in MESH.items()),
    f"training.seq_len={SEQ_LEN}",
    f"data.path={REPO / 'data' / 'sample.txt'}",
    "metrics.enabled=false",
    f"runtime.resources_per_rank={{{NODE_RESOURCE}: 1}}",
)
FAULT_STEP = 8  # the step whose start a kill or a drain hits; a node goes once it has completed
# One replica: the kill a new user tried (issue 39), after the snapshot cadence had a dozen steps to move.
ONE_REPLICA_FAULT_STEP = 12
CHECKPOINT_EVERY = 5  # the reference's checkpoint interval (steps)
# How long the node scenario waits for the new node's replica group to join before giving up.
GROW_WAIT_S = 90.0
GOALS = {"kill_s": 3.0, "node_s": 5.0, "drain_pause_s": 1.0, "grow_s": 10.0, "one_replica_s": 1.0}
SNAPSHOT_STEP_COST_GOAL = 1.03  # pace of a step beside a peer-memory snapshot's copy over one without
# One replica: no surviving replica group can hand the lost rank's state over.
ONE_REPLICA = ("parallelism.dp_replicate=1", "parallelism.dp_shard=4")
SNAPSHOTS_OFF = ("elastic.snapshot_interval_steps=0",)
HEAD_CPUS = 16


# ------------------------------------------------------------------ cluster
class DeathWatch:
    """Driver: notices when a rank actor's process dies, by polling its /proc entry (Linux).

    ``arm()`` takes the rank actors alive now among this process's descendants (the raylets of
    the benchmark's cluster are its children: other jobs on the machine are not watched); the
    watch then keeps, for each, the last time it was seen alive. The first one to die gives
    ``died_at``: the last sighting, so the fault time is never later than the real kill (at most
    ``interval_s`` earlier).
    """

    def __init__(self, marker: bytes = b"RankActor", interval_s: float = 0.005) -> None:
        self.marker = marker
        self.interval_s = interval_s
        self.died_at: float | None = None  # last seen alive
        self.seen_dead_at: float | None = None  # first seen dead: the kill lies in between
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self) -> None:
        if self._thread is not None:
            return
        ours = os.getpid()
        pids = [pid for pid in _pids() if self.marker in _cmdline(pid) and _descends_from(pid, ours)]
        self._thread = threading.Thread(target=self._watch, args=(pids,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self, pids: list[int]) -> None:
        seen = {pid: time.time() for pid in pids}
        while pids and not self._stop.is_set():
            for pid in pids:
                now = time.time()
                if not _alive(pid):
                    self.died_at, self.seen_dead_at = seen[pid], now
                    return
                seen[pid] = now
            time.sleep(self.interval_s)


class ClusterCpu:
    """CPU seconds (user + system) this process and its descendants (the benchmark's Ray cluster:
    raylets, the job's ranks, the driver) had used when each step completed, read from /proc as
    the step event arrives. What snapshots cost a CPU-bound job, measured in a way the machine's
    other load barely moves, unlike the step times (other jobs share this machine's cores)."""

    def __init__(self) -> None:
        self.at_step: dict[int, float] = {}
        self._pids: list[int] | None = None  # taken at the first step: every rank is up by then

    def on_event(self, event: dict[str, Any]) -> None:
        if event["event"] != "step" or event["step"] in self.at_step:
            return
        if self._pids is None:
            ours = os.getpid()
            self._pids = [ours, *(pid for pid in _pids() if pid != ours and _descends_from(pid, ours))]
        self.at_step[event["step"]] = sum(_cpu_s(pid) for pid in self._pids)

    def per_step(self, *, after: int) -> dict[int, float]:
        """CPU seconds each step past ``after`` took, the step before it complete."""
        done = self.at_step
        return {step: done[step] - done[step - 1] for step in sorted(done) if step > after + 1 and step - 1 in done}


def _cpu_s(pid: int) -> float:
    fields = _stat(pid)  # utime and stime: fields 14 and 15 of /proc/PID/stat, in clock ticks
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if len(fields) > 12 else 0.0


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def _stat(pid: int) -> list[bytes]:
    """Fields of /proc/PID/stat after the command name: state, ppid, ...; [] when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return bool(fields) and fields[0] not in (b"Z", b"X")


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        fields = _stat(pid)
        if len(fields) < 2:
            return False
        pid = int(fields[1])
        if pid == ancestor:
            return True
    return False


def start_cluster():
    import ray
    from ray.cluster_utils import Cluster

    from orchestrator.driver.cluster import worker_pythonpath

    # Raylets started here, and their workers, inherit the environment: they import this code.
    os.environ["PYTHONPATH"] = worker_pythonpath()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": HEAD_CPUS, "include_dashboard": False})
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
    return cluster


# ------------------------------------------------------------------ meshpilot
class _Subscriber:
    def __init__(self, on_event: Callable[[dict[str, Any]], None]) -> None:
        self.on_event = on_event


def job_config(steps: int, overrides: tuple[str, ...] = ()):
    from orchestrator.config import load_config

    return load_config(DEMO_CONFIG, [*LAYOUT, f"training.steps={steps}", *overrides])


def run_meshpilot(
    run_dir: Path,
    *,
    steps: int,
    faults: tuple[str, ...],
    on_event=None,
    node_fault=None,
    overrides: tuple[str, ...] = (),
):
    """One meshpilot job on the benchmark's cluster; its events. ``on_event`` may raise
    ``StopRun`` to end the job early (as Ctrl-C does: after the step in flight)."""
    from orchestrator.driver.run import run_training
    from orchestrator.observe.events import read_events
    from workers.faults import FaultSpec

    stopped = []

    def watch(event):
        try:
            if on_event is not None:
                on_event(event)
        except StopRun:
            stopped.append(event)
            raise KeyboardInterrupt from None  # the controller's Ctrl-C path: stop after the step in flight

    result = run_training(
        job_config(steps, overrides),
        run_dir,
        faults=tuple(FaultSpec.parse(f) for f in faults),
        node_fault=node_fault,
        subscribers=[_Subscriber(watch)],
    )
    if result.exit_code != 0 and not (stopped and result.status == "interrupted"):
        raise RuntimeError(f"meshpilot run {run_dir} ended {result.status}: {result.reason}")
    return read_events(run_dir / "events.jsonl")


class StopRun(Exception):
    """Raised by a scenario's event hook once it has seen what it measures."""


def meshpilot_kill(
    cluster, run_dir: Path, *, steps: int, overrides: tuple[str, ...] = (), fault_step: int = FAULT_STEP
) -> dict[str, Any]:
    """SIGKILL of rank 3 (replica group 1 with the default layout) at the start of ``fault_step``."""
    nodes, watch = WorkerNodes(cluster, 2, ranks_per_node=2), DeathWatch()

    def arm_before_the_kill(event):
        if event["event"] == "step":  # the ranks are up; the first step event comes long before the kill
            watch.arm()

    try:
        events = run_meshpilot(
            run_dir, steps=steps, faults=(f"kill@{fault_step}:3",), on_event=arm_before_the_kill, overrides=overrides
        )
    finally:
        watch.close()
        nodes.close()
    # The kill fires right after rank 3 reported fault_step - 1: within milliseconds of that step's completion.
    previous_step_at = step_completed_at(events, fault_step - 1)
    fault_at = watch.died_at
    if fault_at is None or abs(fault_at - previous_step_at) > 1.0:
        print(
            f"  warning: the kill was not seen in /proc; timing it from step {fault_step - 1}'s completion", flush=True
        )
        fault_at = previous_step_at
    change = mesh_change(events, after_event="failure", new_mesh_event="recovered", began_at=fault_at)
    [recovered] = of_kind(events, "recovered")
    return {
        "fault_to_step_s": change.to_first_step_s,
        "lost_steps": change.lost_steps,
        "controller_lost_steps": recovered["lost_steps"],
        "mttr_s": recovered["mttr_s"],
        "detection_s": change.to_first_step_s - recovered["mttr_s"],  # mttr_s runs from detection
        "from_previous_step_s": change.first_step_at - previous_step_at,
        **first_step_figures(change),
        "source": recovered.get("source"),
        "new_mesh": recovered["new_mesh"],
        "kill_seen": fault_at == watch.died_at,
        "kill_window_s": (
            None if watch.died_at is None or watch.seen_dead_at is None else watch.seen_dead_at - watch.died_at
        ),
        "losses": _losses(events, upto=fault_step - 1),
        "snapshot_interval_steps": _final_snapshot_interval(events),
    }


def snapshot_step_cost(cluster, run_dir: Path, *, steps: int) -> dict[str, Any]:
    """What peer-memory snapshots cost the steps of one-replica jobs, two ways.

    In one run: a job snapshotting every second step (the cadence held still), so snapshots go on
    and off step by step and the machine's load (other jobs, start-up) hits both alike: the
    median pace of the steps that run beside a snapshot's copy (each step after a snapshotted
    one) over the median pace of the others, and the same for the CPU the cluster's processes
    used per step (``ClusterCpu``: on this CPU-bound machine, what a step costs). Across runs:
    jobs with snapshots every step (the defaults) and off, in the order off, on, on, off
    (balanced, since the first runs after another scenario start on a busier machine): the ratio
    of their median paces and of their CPU per step, the median wait for a snapshot before an
    update, the interval the cadence ended with, and the host memory per rank. A pace is the
    time between the slowest rank's completions of consecutive steps: it counts every wait
    snapshots cause, inside the step or between steps.
    """
    nodes = WorkerNodes(cluster, 2, ranks_per_node=2)
    paces: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    in_step: dict[bool, list[float]] = {True: [], False: []}
    waits: list[float] = []
    memory: list[int] = []
    intervals: list[int] = []
    try:
        every_other = (*ONE_REPLICA, "elastic.snapshot_interval_steps=2", "elastic.snapshot_overhead_limit=0")
        used = ClusterCpu()
        events = run_meshpilot(
            run_dir / "alternating", steps=2 * steps, faults=(), overrides=every_other, on_event=used.on_event
        )
        done = {e["step"]: e["completed_at"] for e in of_kind(events, "step")}
        alternating = {
            beside_a_copy: [
                done[step] - done[step - 1] for step in done if step > 4 and (step % 2 == 1) == beside_a_copy
            ]
            for beside_a_copy in (True, False)
        }
        alternating_cpu = {
            beside_a_copy: [
                seconds for step, seconds in used.per_step(after=3).items() if (step % 2 == 1) == beside_a_copy
            ]
            for beside_a_copy in (True, False)
        }
        for number, snapshots_on in enumerate((False, True, True, False)):
            overrides = ONE_REPLICA if snapshots_on else (*ONE_REPLICA, *SNAPSHOTS_OFF)
            used = ClusterCpu()
            events = run_meshpilot(
                run_dir / f"{number}-{'on' if snapshots_on else 'off'}",
                steps=steps,
                faults=(),
                overrides=overrides,
                on_event=used.on_event,
            )
            steady = [e for e in of_kind(events, "step") if e["step"] > 3]
            paces[snapshots_on] += step_paces(events, after=3)
            cpu[snapshots_on] += list(used.per_step(after=3).values())
            in_step[snapshots_on] += [e["step_time_s"] for e in steady]
            memory += [e["max_bytes"] for e in of_kind(events, "snapshot_memory")]
            if snapshots_on:
                waits += [e["phases_s"].get("snapshot_wait_s", 0.0) for e in steady if e.get("phases_s")]
                intervals.append(_final_snapshot_interval(events))
    finally:
        nodes.close()
    beside_s, alone_s = median(alternating[True]), median(alternating[False])
    on_s, off_s = median(paces[True]), median(paces[False])
    in_on_s, in_off_s = median(in_step[True]), median(in_step[False])
    return {
        "step_beside_copy_s": beside_s,
        "step_alone_s": alone_s,
        "ratio": _ratio(beside_s, alone_s),
        # Means: a process's CPU is read in clock ticks (10 ms); over many steps they even out.
        "cpu_ratio": _ratio(_mean(alternating_cpu[True]), _mean(alternating_cpu[False])),
        "step_on_s": on_s,
        "step_off_s": off_s,
        "ratio_across_runs": _ratio(on_s, off_s),
        "cpu_ratio_across_runs": _ratio(_mean(cpu[True]), _mean(cpu[False])),
        "in_step_ratio": _ratio(in_on_s, in_off_s),
        "snapshot_wait_s": median(waits),
        "interval_steps": max(intervals, default=None),
        "host_bytes_per_rank": max(memory, default=None),
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if not numerator or not denominator else numerator / denominator


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def step_paces(events: list[dict[str, Any]], *, after: int) -> list[float]:
    """Seconds between the slowest rank's completions of consecutive steps past ``after``."""
    done = {e["step"]: e["completed_at"] for e in of_kind(events, "step") if e.get("completed_at") is not None}
    return [done[step] - done[step - 1] for step in sorted(done) if step > after + 1 and step - 1 in done]


def _final_snapshot_interval(events: list[dict[str, Any]]) -> int:
    """The peer-memory snapshot interval a run ended with (the cadence's last word; 1 if it never spoke)."""
    changes = of_kind(events, "snapshot_interval")
    return changes[-1]["interval_steps"] if changes else 1


def meshpilot_node_then_grow(
    cluster, run_dir: Path, *, steps: int, overrides: tuple[str, ...] = ()
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The node of rank 2 (replica group 1) removed once FAULT_STEP completed; a new node added
    as soon as the job recovered, which it grows onto. ``overrides``: config keys on top of the
    benchmark's layout (bench/compile.py turns compilation on)."""
    nodes = WorkerNodes(cluster, 2, ranks_per_node=2)
    removed: dict[str, float] = {}
    added: dict[str, float] = {}

    def remove_node(node_id: str) -> None:
        removed["at"] = time.time()
        nodes.remove(node_id)
        removed["remove_s"] = time.time() - removed["at"]

    def add_a_node_after_recovery(event):
        # The controller's loop runs in the main thread: add_node may be called here.
        if event["event"] == "recovered" and not added:
            added["called_at"] = time.time()
            nodes.add()
            added["at"] = time.time()
        elif event["event"] == "grow":
            added["grown_at_step"] = event_step[0]
        elif event["event"] == "step":
            event_step[0] = event["step"]
            grown = added.get("grown_at_step")
            if (grown is not None and event["step"] >= grown + 2) or (
                "at" in added and time.time() > added["at"] + GROW_WAIT_S
            ):
                print("  (node run: the figures are in; the benchmark stops the job, hence 'interrupted')", flush=True)
                raise StopRun  # no need to train to the end

    event_step = [0]
    try:
        events = run_meshpilot(
            run_dir,
            steps=steps,
            faults=(f"node@{FAULT_STEP}:2",),
            node_fault=remove_node,
            on_event=add_a_node_after_recovery,
            overrides=overrides,
        )
    finally:
        nodes.close()
    change = mesh_change(events, after_event="failure", new_mesh_event="recovered", began_at=removed["at"])
    [recovered] = of_kind(events, "recovered")
    node = {
        "fault_to_step_s": change.to_first_step_s,
        "lost_steps": change.lost_steps,
        "controller_lost_steps": recovered["lost_steps"],
        "mttr_s": recovered["mttr_s"],
        "detection_s": change.to_first_step_s - recovered["mttr_s"],
        "remove_node_s": removed["remove_s"],
        **first_step_figures(change),
    }
    grow: dict[str, Any] = {"node_to_step_s": None, "join_s": None, "add_node_s": None}
    if of_kind(events, "grow") and added:
        growth = mesh_change(events, after_event="recovered", new_mesh_event="grow", began_at=added["at"])
        grow = {
            "node_to_step_s": growth.to_first_step_s,
            "join_s": of_kind(events, "grow")[0]["join_s"],
            "add_node_s": added["at"] - added["called_at"],
            "lost_steps": growth.lost_steps,
            **first_step_figures(growth),
        }
    else:
        print(f"  warning: the run ended before the new node's replica joined (raise the steps): {run_dir}")
    return node, grow


def meshpilot_drain(cluster, run_dir: Path, *, steps: int) -> dict[str, Any]:
    """A Ray drain notice (preemption) for the node of rank 2, given at the start of FAULT_STEP."""
    nodes = WorkerNodes(cluster, 2, ranks_per_node=2)
    try:
        events = run_meshpilot(run_dir, steps=steps, faults=(f"drain@{FAULT_STEP}:2",))
    finally:
        nodes.close()
    # The notice goes out as rank 2 starts FAULT_STEP, right after its FAULT_STEP - 1.
    notice_at = step_completed_at(events, FAULT_STEP - 1)
    change = mesh_change(events, after_event="drain", new_mesh_event="recovered", began_at=notice_at)
    [recovered] = of_kind(events, "recovered")
    if of_kind(events, "failure"):
        raise RuntimeError(f"the drain run {run_dir} recorded a failure: {of_kind(events, 'failure')}")
    return {
        "pause_s": change.pause_s,
        "idle_s": change.idle_s,
        "lost_steps": change.lost_steps,
        "controller_lost_steps": recovered["lost_steps"],
        "mttr_s": recovered["mttr_s"],
        "notice_to_step_s": change.to_first_step_s,
        "steps_after_notice": change.first_step - FAULT_STEP,
        **first_step_figures(change),
    }


def first_step_figures(change: MeshChange) -> dict[str, float | None]:
    """The first step on the new mesh and the median of the later ones on it (slowest rank)."""
    return {"first_step_s": change.first_step_time_s, "steady_step_s": change.steady_step_time_s}


def _losses(events, *, upto: int) -> dict[int, float]:
    # A step whose killed rank never reported carries a partial loss: not comparable.
    return {
        e["step"]: e["loss"] for e in events if e["event"] == "step" and e["step"] <= upto and not e.get("loss_partial")
    }


# ------------------------------------------------------------------ the reference
def reference_run(workdir: Path, *, steps: int, faults: list[dict[str, Any]] | None = None, on_step=None):
    from bench.support.recovery_reference import run_reference
    from orchestrator.driver.train_spec import data_bytes, train_spec

    config = job_config(steps)
    data = data_bytes(config)
    assert data is not None  # the benchmark's job trains on text, which the reference's TextSource needs
    return run_reference(
        spec=train_spec(config, backend="gloo"),
        mesh=MESH,
        data=data,
        workdir=workdir,
        checkpoint_every=CHECKPOINT_EVERY,
        faults=faults,
        on_step=on_step,
        resources_per_worker={"CPU": 0.5, NODE_RESOURCE: 1},
    )


def reference_kill(cluster, workdir: Path, *, steps: int) -> dict[str, Any]:
    """A Ray Train worker (world rank 3) SIGKILLs itself at the start of FAULT_STEP."""
    nodes = WorkerNodes(cluster, 2, ranks_per_node=2)
    try:
        records = reference_run(workdir, steps=steps, faults=[{"kind": "kill", "step": FAULT_STEP, "rank": 3}])
    finally:
        nodes.close()
    kill = next(r for r in records if r["kind"] == "kill")
    return {**_restart_figures(records, fault_at=kill["time"]), "losses": _reference_losses(records)}


def reference_node(cluster, workdir: Path, *, steps: int) -> dict[str, Any]:
    """The node of world rank 3 removed once every worker completed FAULT_STEP; a third node
    stands by, so the restarted group (always the full 4 workers) has somewhere to go."""
    nodes = WorkerNodes(cluster, 3, ranks_per_node=2)
    removed: dict[str, float] = {}

    def remove_after_fault_step(records):
        done = {r["rank"] for r in records if r["kind"] == "step" and r["attempt"] == 1 and r["step"] == FAULT_STEP}
        if len(done) == WORLD_SIZE and not removed:
            node_id = next(r["node"] for r in records if r["kind"] == "start" and r["rank"] == 3)
            removed["at"] = time.time()  # Cluster.remove_node needs no main thread
            nodes.remove(node_id)

    try:
        records = reference_run(workdir, steps=steps, on_step=remove_after_fault_step)
    finally:
        nodes.close()
    if not removed:
        raise RuntimeError("the reference finished before its node could be removed")
    return _restart_figures(records, fault_at=removed["at"])


def _restart_figures(records, *, fault_at: float) -> dict[str, Any]:
    restart = restart_from_records(records, fault_at=fault_at, world_size=WORLD_SIZE)
    return {
        "fault_to_step_s": restart.to_first_step_s,
        "lost_steps": restart.lost_steps,
        "to_new_progress_s": restart.to_new_progress_s,
        "resumed_from": restart.resumed_from,
        "to_workers_ready_s": restart.to_workers_ready_s,
        "last_step_before": restart.last_step_before,
    }


def _reference_losses(records) -> dict[int, float]:
    by_step: dict[int, list[float]] = {}
    for record in records:
        if record["kind"] == "step" and record["attempt"] == 1 and record["loss"] is not None:
            by_step.setdefault(record["step"], []).append(record["loss"])
    return {step: sum(values) / len(values) for step, values in by_step.items() if len(values) == WORLD_SIZE}


# ------------------------------------------------------------------ the run
SCENARIOS = (
    "meshpilot_kill",
    "meshpilot_node",
    "meshpilot_drain",
    "reference_kill",
    "reference_node",
    "one_replica_memory",
    "one_replica_storage",
    "snapshot_cost",
)


def run_all(
    cluster, workdir: Path, *, repeats: int, quick: bool, storage: tuple[str, str], only: set[str] | None = None
) -> tuple[dict[str, list[dict]], list[str]]:
    """Every scenario ``repeats`` times, rounds interleaved so that noise hits all alike.
    ``storage``: (S3 URI prefix, endpoint) for the one-replica restore from storage."""
    # Enough steps after the fault for the figures; the node run stops on its own once grown.
    steps, node_steps = FAULT_STEP + 8, FAULT_STEP + 400

    def one_replica_kill(run_dir: Path, overrides: tuple[str, ...]) -> dict[str, Any]:
        fault_step = ONE_REPLICA_FAULT_STEP
        return meshpilot_kill(cluster, run_dir, steps=fault_step + 8, overrides=overrides, fault_step=fault_step)

    def one_replica_storage(run_dir: Path) -> tuple[str, ...]:
        uri, endpoint = storage
        return (
            *ONE_REPLICA,
            *SNAPSHOTS_OFF,
            f"checkpoint.uri={uri}/{run_dir.name}",  # a prefix per run: nothing to resume from
            f"checkpoint.endpoint_url={endpoint}",
            f"checkpoint.interval_steps={CHECKPOINT_EVERY}",
        )

    results: dict[str, list[dict]] = {name: [] for name in (*SCENARIOS, "meshpilot_grow")}
    errors: list[str] = []
    scenarios: list[tuple[str, Callable[[Path], Any]]] = [
        ("meshpilot_kill", lambda d: meshpilot_kill(cluster, d, steps=steps)),
        ("meshpilot_node", lambda d: meshpilot_node_then_grow(cluster, d, steps=node_steps)),
        ("meshpilot_drain", lambda d: meshpilot_drain(cluster, d, steps=steps)),
        ("reference_kill", lambda d: reference_kill(cluster, d, steps=steps)),
        ("one_replica_memory", lambda d: one_replica_kill(d, ONE_REPLICA)),
        ("one_replica_storage", lambda d: one_replica_kill(d, one_replica_storage(d))),
        ("snapshot_cost", lambda d: snapshot_step_cost(cluster, d, steps=16 if quick else 30)),
    ]
    if not quick:
        scenarios.append(("reference_node", lambda d: reference_node(cluster, d, steps=steps)))
    if only is not None:
        scenarios = [(name, scenario) for name, scenario in scenarios if name in only]
    for round_number in range(1, repeats + 1):
        for name, scenario in scenarios:
            started = time.monotonic()
            try:
                figures = scenario(workdir / f"{name}-{round_number}")
            except Exception:  # noqa: BLE001 - one broken scenario must not hide the others' figures
                errors.append(f"{name} round {round_number}: {traceback.format_exc(limit=4)}")
                print(f"[{round_number}/{repeats}] {name}: FAILED (see the JSON's errors)", flush=True)
                continue
            if name == "meshpilot_node":
                figures, grow = figures
                results["meshpilot_grow"].append(grow)
            results[name].append(figures)
            shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items() if k != "losses"}
            print(f"[{round_number}/{repeats}] {name} ({time.monotonic() - started:.0f} s): {shown}", flush=True)
    return results, errors


# ------------------------------------------------------------------ the report
def summarize(results: dict[str, list[dict]]) -> dict[str, Any]:
    def mid(name: str, key: str) -> float | None:
        return _round(median(r.get(key) for r in results[name]))

    def first_step_medians(name: str) -> dict[str, Any]:
        return {"ours_first_step_s": mid(name, "first_step_s"), "ours_steady_step_s": mid(name, "steady_step_s")}

    def worst(name: str, key: str) -> int | None:
        values = [r[key] for r in results[name] if r.get(key) is not None]
        return max(values) if values else None

    kill: dict[str, Any] = {
        "ours_s": mid("meshpilot_kill", "fault_to_step_s"),
        "ours_lost_steps": worst("meshpilot_kill", "lost_steps"),
        "ours_mttr_s": mid("meshpilot_kill", "mttr_s"),
        "ours_detection_s": mid("meshpilot_kill", "detection_s"),
        "ours_from_previous_step_s": mid("meshpilot_kill", "from_previous_step_s"),
        **first_step_medians("meshpilot_kill"),
        "reference_s": mid("reference_kill", "fault_to_step_s"),
        "reference_lost_steps": worst("reference_kill", "lost_steps"),
        "reference_to_new_progress_s": mid("reference_kill", "to_new_progress_s"),
        "goal_s": GOALS["kill_s"],
    }
    node: dict[str, Any] = {
        "ours_s": mid("meshpilot_node", "fault_to_step_s"),
        "ours_lost_steps": worst("meshpilot_node", "lost_steps"),
        "ours_mttr_s": mid("meshpilot_node", "mttr_s"),
        "ours_detection_s": mid("meshpilot_node", "detection_s"),
        **first_step_medians("meshpilot_node"),
        "reference_s": mid("reference_node", "fault_to_step_s"),
        "reference_lost_steps": worst("reference_node", "lost_steps"),
        "reference_to_new_progress_s": mid("reference_node", "to_new_progress_s"),
        "goal_s": GOALS["node_s"],
    }
    drain: dict[str, Any] = {
        "ours_pause_s": mid("meshpilot_drain", "pause_s"),
        "ours_idle_s": mid("meshpilot_drain", "idle_s"),
        "ours_lost_steps": worst("meshpilot_drain", "lost_steps"),
        "ours_mttr_s": mid("meshpilot_drain", "mttr_s"),
        "ours_notice_to_step_s": mid("meshpilot_drain", "notice_to_step_s"),
        **first_step_medians("meshpilot_drain"),
        "goal_pause_s": GOALS["drain_pause_s"],
    }
    grow: dict[str, Any] = {
        "ours_node_to_step_s": mid("meshpilot_grow", "node_to_step_s"),
        "ours_join_s": mid("meshpilot_grow", "join_s"),
        "ours_add_node_s": mid("meshpilot_grow", "add_node_s"),
        **first_step_medians("meshpilot_grow"),
        "goal_s": GOALS["grow_s"],
    }
    one_replica: dict[str, Any] = {
        "ours_s": mid("one_replica_memory", "fault_to_step_s"),
        "ours_lost_steps": worst("one_replica_memory", "lost_steps"),
        "ours_source": next((r["source"] for r in results["one_replica_memory"]), None),
        "ours_first_step_s": mid("one_replica_memory", "first_step_s"),
        "ours_snapshot_interval_steps": worst("one_replica_memory", "snapshot_interval_steps"),
        "fault_step": ONE_REPLICA_FAULT_STEP,
        "ours_new_mesh": next((r["new_mesh"] for r in results["one_replica_memory"]), None),
        "storage_s": mid("one_replica_storage", "fault_to_step_s"),
        "storage_lost_steps": worst("one_replica_storage", "lost_steps"),
        "reference_s": kill["reference_s"],
        "reference_lost_steps": kill["reference_lost_steps"],
        "goal_s": GOALS["one_replica_s"],
    }
    one_replica["ratio_vs_storage"] = _round(ratio(one_replica["storage_s"], one_replica["ours_s"]))
    snapshots: dict[str, Any] = {
        "step_beside_copy_s": mid("snapshot_cost", "step_beside_copy_s"),
        "step_alone_s": mid("snapshot_cost", "step_alone_s"),
        "ratio": mid("snapshot_cost", "ratio"),
        "step_on_s": mid("snapshot_cost", "step_on_s"),
        "step_off_s": mid("snapshot_cost", "step_off_s"),
        "ratio_across_runs": mid("snapshot_cost", "ratio_across_runs"),
        "cpu_ratio": mid("snapshot_cost", "cpu_ratio"),
        "cpu_ratio_across_runs": mid("snapshot_cost", "cpu_ratio_across_runs"),
        "in_step_ratio": mid("snapshot_cost", "in_step_ratio"),
        "snapshot_wait_s": mid("snapshot_cost", "snapshot_wait_s"),
        "interval_steps": worst("snapshot_cost", "interval_steps"),
        "host_bytes_per_rank": worst("snapshot_cost", "host_bytes_per_rank"),
        "goal_ratio": SNAPSHOT_STEP_COST_GOAL,
    }
    snapshots["met"] = _met(snapshots["ratio"], SNAPSHOT_STEP_COST_GOAL)
    for entry in (kill, node, one_replica):
        entry["ratio"] = _round(ratio(entry["reference_s"], entry["ours_s"]))
        entry["met"] = _met(entry["ours_s"], entry["goal_s"]) and entry["ours_lost_steps"] == 0
    drain["met"] = _met(drain["ours_pause_s"], drain["goal_pause_s"]) and drain["ours_lost_steps"] == 0
    grow["met"] = _met(grow["ours_node_to_step_s"], grow["goal_s"])
    return {
        "kill": kill,
        "node": node,
        "drain": drain,
        "grow": grow,
        "one_replica": one_replica,
        "snapshots": snapshots,
    }


def loss_parity(results: dict[str, list[dict]]) -> float | None:
    """Largest relative loss difference between meshpilot and the reference before the fault:
    the same model, data and step on both sides give the same losses."""
    ours = results["meshpilot_kill"][0]["losses"] if results["meshpilot_kill"] else {}
    theirs = results["reference_kill"][0]["losses"] if results["reference_kill"] else {}
    common = sorted(set(ours) & set(theirs))
    if not common:
        return None
    return max(abs(ours[step] - theirs[step]) / abs(theirs[step]) for step in common)


def print_table(summary: dict[str, Any], *, node_reference_note: str | None) -> None:
    def s(value) -> str:
        return "-" if value is None else (f"{value:.2f} s" if isinstance(value, float) else str(value))

    def x3(value) -> str:
        return "-" if value is None else f"{value:.3f}x"

    def x(value) -> str:
        return "-" if value is None else f"{value:.1f}x"

    def first_and_later(figures: dict[str, Any]) -> str:
        return f"{s(figures['ours_first_step_s'])} / {s(figures['ours_steady_step_s'])}"

    kill, node, drain, grow = summary["kill"], summary["node"], summary["drain"], summary["grow"]
    one, snap = summary["one_replica"], summary["snapshots"]
    rows = [
        ("scenario", "figure", "meshpilot", "Ray Train V2", "ratio", "goal"),
        (
            "SIGKILL one rank",
            "fault -> first step",
            s(kill["ours_s"]),
            s(kill["reference_s"]),
            x(kill["ratio"]),
            f"<= {GOALS['kill_s']:g} s",
        ),
        ("", "completed steps lost", s(kill["ours_lost_steps"]), s(kill["reference_lost_steps"]), "", "0"),
        ("", "fault -> new progress", s(kill["ours_s"]), s(kill["reference_to_new_progress_s"]), "", ""),
        ("", "controller mttr_s", s(kill["ours_mttr_s"]), "", "", ""),
        ("", "first step on the new mesh / later", first_and_later(kill), "", "", ""),
        (
            "node removed",
            "fault -> first step",
            s(node["ours_s"]),
            s(node["reference_s"]),
            x(node["ratio"]),
            f"<= {GOALS['node_s']:g} s",
        ),
        ("", "controller mttr_s", s(node["ours_mttr_s"]), "", "", ""),
        ("", "first step on the new mesh / later", first_and_later(node), "", "", ""),
        ("", "completed steps lost", s(node["ours_lost_steps"]), s(node["reference_lost_steps"]), "", "0"),
        ("", "fault -> new progress", s(node["ours_s"]), s(node["reference_to_new_progress_s"]), "", ""),
        ("drain notice", "pause (step to step)", s(drain["ours_pause_s"]), "", "", f"<= {GOALS['drain_pause_s']:g} s"),
        ("", "  of it, no step running", s(drain["ours_idle_s"]), "", "", ""),
        ("", "completed steps lost", s(drain["ours_lost_steps"]), "", "", "0"),
        ("", "controller mttr_s", s(drain["ours_mttr_s"]), "", "", ""),
        ("", "first step on the new mesh / later", first_and_later(drain), "", "", ""),
        (
            "grow (node added)",
            "node up -> first step",
            s(grow["ours_node_to_step_s"]),
            "",
            "",
            f"<= {GOALS['grow_s']:g} s",
        ),
        ("", "join pause (join_s)", s(grow["ours_join_s"]), "", "", ""),
        ("", "first step on the new mesh / later", first_and_later(grow), "", "", ""),
        (
            "one replica, SIGKILL",
            "fault -> first step (peer memory)",
            s(one["ours_s"]),
            s(one["reference_s"]),
            x(one["ratio"]),
            f"<= {GOALS['one_replica_s']:g} s",
        ),
        ("", "completed steps lost", s(one["ours_lost_steps"]), s(one["reference_lost_steps"]), "", "0"),
        ("", "snapshot interval at the kill", s(one["ours_snapshot_interval_steps"]), "", "", "1"),
        ("", "  snapshots off: from S3", s(one["storage_s"]), "", x(one["ratio_vs_storage"]), ""),
        ("", "  snapshots off: steps lost", s(one["storage_lost_steps"]), "", "", ""),
        (
            "snapshot cost",
            "step beside a copy / not (one run)",
            f"{s(snap['step_beside_copy_s'])} / {s(snap['step_alone_s'])}",
            "",
            "-" if snap["ratio"] is None else f"{snap['ratio']:.3f}x",
            f"<= {SNAPSHOT_STEP_COST_GOAL}x",
        ),
        ("", "CPU per step beside a copy / not (one run)", x3(snap["cpu_ratio"]), "", "", ""),
        ("", "CPU per step on / off (across runs)", x3(snap["cpu_ratio_across_runs"]), "", "", ""),
        (
            "",
            "step pace on / off (across runs)",
            f"{s(snap['step_on_s'])} / {s(snap['step_off_s'])}",
            "",
            "-" if snap["ratio_across_runs"] is None else f"{snap['ratio_across_runs']:.3f}x",
            "",
        ),
        (
            "",
            "step time (in the step) on / off",
            "-" if snap["in_step_ratio"] is None else f"{snap['in_step_ratio']:.3f}x",
            "",
            "",
            "",
        ),
        ("", "wait before an update (median)", s(snap["snapshot_wait_s"]), "", "", ""),
        ("", "interval the cadence ended with", s(snap["interval_steps"]), "", "", "1"),
        (
            "",
            "host memory per rank",
            "-" if snap["host_bytes_per_rank"] is None else f"{snap['host_bytes_per_rank'] / 2**20:.1f} MiB",
            "",
            "",
            "",
        ),
    ]
    print(table(rows))
    if node_reference_note:
        print(f"Ray Train, node removed: {node_reference_note}")


def record_figures(summary: dict[str, Any]) -> None:
    from orchestrator.analysis.bench_figures import DEFAULT_PATH, record_figure

    layout = "4 ranks as dp_replicate=2 x dp_shard=2, debug model, CPU gloo, 2-core machine"
    figures = [
        (
            "inplace_recovery_s",
            summary["kill"]["ours_s"],
            f"SIGKILL of one rank to the first step on the smaller mesh; {layout}",
        ),
        (
            "drain_recovery_s",
            summary["drain"]["ours_pause_s"],
            f"drain notice: last step on the old mesh to the first on the smaller one; {layout}",
        ),
        ("grow_s", summary["grow"]["ours_join_s"], f"pause while a new replica group joins (grow join_s); {layout}"),
        (
            "restart_recovery_s",
            summary["kill"]["reference_s"],
            "Ray Train V2 TorchTrainer restarting every worker after a SIGKILL, to its first step from the last "
            f"registered checkpoint (steps since then are redone on top); {layout}",
        ),
    ]
    for name, value, note in figures:
        if value is not None:
            record_figure(DEFAULT_PATH, name, value, bench=BENCH, world_size=WORLD_SIZE, note=note)


def _met(value: float | None, goal: float) -> bool | None:
    return None if value is None else value <= goal


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each scenario once, Ray Train's lost node left out")
    parser.add_argument("--repeats", type=int, default=None, help="rounds of every scenario (default 3, --quick 1)")
    parser.add_argument(
        "--only", default=None, help=f"comma-separated scenarios to run (default: all of {', '.join(SCENARIOS)})"
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="keep every run's directory (events, logs, the reference's records) here",
    )
    args = parser.parse_args()
    unknown = sorted(set(args.only.split(",")) - set(SCENARIOS)) if args.only else []
    if unknown or args.only == "":
        missing = ", ".join(unknown) or "(empty)"
        parser.error(f"--only {args.only!r}: no scenario {missing}; choose from {', '.join(SCENARIOS)}")
    repeats = args.repeats or (1 if args.quick else 3)
    import ray

    print(
        f"recovery benchmark: {WORLD_SIZE} ranks {MESH}, debug model, seq_len {SEQ_LEN}, fault at step {FAULT_STEP}, "
        f"{repeats} round(s)",
        flush=True,
    )
    from checkpointing.local_s3 import LocalS3Server

    with tempfile.TemporaryDirectory(prefix="meshpilot-recovery-") as tmp, LocalS3Server() as s3:
        workdir = args.keep or Path(tmp)
        s3.create_bucket("bench")
        os.environ.update(s3.env())  # before the cluster starts: its ranks inherit the credentials
        storage = ("s3://bench/recovery", s3.endpoint_url)
        cluster = start_cluster()
        try:
            only = set(args.only.split(",")) if args.only else None
            results, errors = run_all(cluster, workdir, repeats=repeats, quick=args.quick, storage=storage, only=only)
        finally:
            ray.shutdown()
            cluster.shutdown()
    summary = summarize(results)
    node_note = "not measured with --quick (a lost node takes Ray Train about a minute)" if args.quick else None
    print()
    print_table(summary, node_reference_note=node_note)
    parity = loss_parity(results)
    if parity is not None:
        print(f"same job on both sides: losses before the fault differ by at most {parity:.1e} (relative)")
    record_figures(summary)
    runs = {name: [{k: v for k, v in r.items() if k != "losses"} for r in rows] for name, rows in results.items()}
    emit(
        {
            "benchmark": "recovery",
            "quick": args.quick,
            "repeats": repeats,
            "world_size": WORLD_SIZE,
            "mesh": MESH,
            "model": "debug",
            "seq_len": SEQ_LEN,
            "global_batch": 16,
            "fault_step": FAULT_STEP,
            "one_replica_fault_step": ONE_REPLICA_FAULT_STEP,
            "reference": (
                "Ray Train V2 TorchTrainer (ray " + ray.__version__ + "): the same Trainer (FSDP2, "
                "dp_replicate=2 x dp_shard=2), data and batch, gloo on CPU, ray.train.report every step, "
                f"a checkpoint every {CHECKPOINT_EVERY} steps, FailureConfig(max_failures=1)"
            ),
            **summary,
            "node_reference_note": node_note,
            "loss_parity_max_rel_diff": parity,
            "runs": runs,
            "errors": errors,
        }
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
