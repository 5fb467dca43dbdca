"""Chaos soak: a long run under a seeded schedule of overlapping faults of every kind, every invariant checked.

    python bench/chaos.py               # 200 steps, 30 faults (several times --quick's time)
    python bench/chaos.py --quick       # 60 steps, 9 faults: one every ~7 steps (about 8 min on 2 cores)
    python bench/chaos.py --seed 7 --faults 12 --steps 90 --keep runs/chaos   # another schedule, run dirs kept
    python bench/chaos.py --quick --separate-networks   # worker nodes on networks of their own (root):
                                                        # partitions and slow links drawn too

One Ray cluster (``ray.cluster_utils.Cluster``: a head node plus two worker nodes that offer the
custom resource ``faultnode``, as in tests/faults/test_chaos.py) and one local S3 server
(SeaweedFS). The job is that test's: the demo model (debug preset) on the sample text, 4 ranks as
dp_replicate=2 x dp_shard=2, seq_len 32, 2 spare actors, a checkpoint to S3 every 3 steps,
``data.record_samples=true``. Three runs:

1. meshpilot, uninterrupted: the losses every step must match, and the goodput the chaos run's is
   compared with.
2. meshpilot under ``chaos_schedule(seed, faults)`` (``orchestrator/driver/chaos.py``): ranks
   killed, raising, hanging, signalled, a storage outage, nodes drained and removed, and faults
   that land while the recovery of another configures. A node comes back for every node lost or
   drained, as an autoscaler would bring one. Then the invariant report
   (``orchestrator/analysis/invariants.py``): finished, every step and sample once, losses equal
   to run 1's, replicas identical, every checkpoint verifies, nothing left on the cluster (checked
   before the worker nodes go).
3. Ray Train V2's ``TorchTrainer`` (``bench/support/recovery_reference.py``: the same Trainer, model,
   layout and data) under the faults of the schedule it meets as given: a worker's process
   SIGKILLed or raising at the start of the same step on the same rank, the node of that rank
   removed once the step completed (a spare node per node fault stands by, since Ray Train
   restarts the whole group at full size). It has no in-place recovery: every fault restarts the
   group from its last checkpoint (every 3 steps, local disk). The other kinds are listed in the
   JSON with why they were not applied; no figure is made up for them.

With ``--separate-networks`` the cluster is tests/fixtures/netns_nodes.py's: a head on a bridge
(the S3 server listens there too) and worker nodes each in a network namespace of its own; the
schedule also draws ``partition`` (a node cut off for ``CHAOS_PARTITION_S``, then back) and
``throttle`` (its link capped at ``CHAOS_THROTTLE_MBIT`` for the rest of the run), whose NODE is
one of the run's two first worker nodes.

How every figure is counted is in ``bench/support/chaos_figures.py``. A run that does not survive is a
result too: its figures, events and the failure are reported, and the exit code is 1. The last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, emit  # noqa: E402
from bench.support.chaos_figures import (  # noqa: E402
    GOODPUT_GOAL,
    chaos_figures,
    describe_fault,
    goals,
    reference_goodput,
    reference_restarts,
    split_for_reference,
)
from bench.support.recovery_timing import table  # noqa: E402
from tests.fixtures.worker_nodes import NODE_RESOURCE, WorkerNodes  # noqa: E402

BENCH = "bench/chaos.py"
DEMO_CONFIG = REPO / "configs" / "tiny-3d.yaml"
MESH = {"dp_replicate": 2, "dp_shard": 2, "tp": 1, "pp": 1}
WORLD_SIZE, REPLICA_SIZE = 4, 2
SEQ_LEN = 32
CHECKPOINT_EVERY = 3
SPARE_ACTORS = 2
# A seed whose 9-fault quick schedule holds every kind of step fault and a /configure one, and
# whose 30-fault schedule holds every kind and both /configure kinds.
DEFAULT_SEED = 366
FULL = {"steps": 200, "faults": 30}
QUICK = {"steps": 60, "faults": 9}
# The job: the same for meshpilot and the reference.
JOB = (
    *(f"parallelism.{name}={degree}" for name, degree in MESH.items()),
    f"training.seq_len={SEQ_LEN}",
    f"data.path={REPO / 'data' / 'sample.txt'}",
)
# How meshpilot runs it: tests/faults/harness.py's elastic layout, on the worker nodes.
MESHPILOT = (
    "elastic.hang_timeout_s=2",  # steady 0.2-0.5 s steps: the hang floor lowered, as such a job would
    "elastic.heartbeat_timeout_s=10",
    f"elastic.spare_actors={SPARE_ACTORS}",
    f"runtime.resources_per_rank={{{NODE_RESOURCE}: 1}}",
    f"checkpoint.interval_steps={CHECKPOINT_EVERY}",
    "data.record_samples=true",
    "metrics.enabled=false",
)
REFERENCE_RESOURCES = {"CPU": 0.5, NODE_RESOURCE: 1}


def job_config(steps: int, *overrides: str):
    from orchestrator.config import load_config

    return load_config(DEMO_CONFIG, [*JOB, f"training.steps={steps}", *overrides])


# ------------------------------------------------------------------ meshpilot
@dataclass
class MeshpilotRun:
    """What one meshpilot run left: how it ended, its events, its invariant report."""

    status: str = "not run"
    exit_code: int | None = None
    reason: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    invariants: Any = None  # orchestrator.analysis.invariants.InvariantReport
    errors: list[str] = field(default_factory=list)
    # Nodes the run's event hook brought back, and the time the controller waited for them.
    nodes_brought_back: dict[str, Any] = field(default_factory=dict)

    @property
    def survived(self) -> bool:
        return self.exit_code == 0 and self.invariants is not None and self.invariants.ok


class NodeReplacements:
    """An event subscriber (driver, the controller's thread): a node back for every node lost or
    drained (``WorkerNodes.replace_gone``), timed, since the controller waits while it starts; a
    node that fails to come is recorded, not raised, as an autoscaler's failure would not end a job."""

    def __init__(self, nodes: WorkerNodes) -> None:
        self.nodes = nodes
        self.added = 0
        self.seconds = 0.0
        self.errors: list[str] = []

    def on_event(self, event: dict[str, Any]) -> None:
        before, started = len(self.nodes.nodes), time.monotonic()
        try:
            self.nodes.replace_gone(event)
        except Exception:  # noqa: BLE001 - reported with the run's errors
            self.errors.append(f"bringing a node back after {event['event']}: {traceback.format_exc(limit=3)}")
        else:
            if len(self.nodes.nodes) == before:
                return  # not an event that takes a node
        self.added += len(self.nodes.nodes) - before
        self.seconds += time.monotonic() - started


def worker_nodes(cluster, count: int):
    """``count`` worker nodes of ``cluster``: ``WorkerNodes`` on a ``ray.cluster_utils.Cluster``,
    ``NetnsWorkerNodes`` on a separate-network one."""
    from tests.fixtures.netns_nodes import NetnsCluster, NetnsWorkerNodes

    return NetnsWorkerNodes(cluster, count) if isinstance(cluster, NetnsCluster) else WorkerNodes(cluster, count)


def run_meshpilot(cluster, s3, run_dir: Path, *, steps: int, schedule=(), seed=None, reference_losses=None):
    """One meshpilot run on two fresh worker nodes, checkpointing to its own bucket; with
    ``schedule``, nodes are removed for node faults and replaced for every node lost or drained,
    and the invariant report is taken before the nodes go."""
    from orchestrator.driver.run import run_training
    from orchestrator.observe.events import read_events

    bucket = f"chaos-{run_dir.name}-{os.getpid()}"
    s3.create_bucket(bucket)
    uri = f"s3://{bucket}/run"
    config = job_config(
        steps,
        *MESHPILOT,
        f"elastic.max_failures={2 * len(schedule) + 5}",  # the failure budget is not what is measured
        f"checkpoint.uri={uri}",
        f"checkpoint.endpoint_url={s3.endpoint_url}",
    )
    run = MeshpilotRun()
    nodes = worker_nodes(cluster, 2)
    replacements = NodeReplacements(nodes)
    try:
        try:
            result = run_training(
                config,
                run_dir,
                faults=tuple(schedule),
                node_fault=nodes.remove,
                network_fault=getattr(nodes, "apply", None),
                subscribers=[replacements],
                chaos_seed=seed,
            )
            run.status, run.exit_code, run.reason = result.status, result.exit_code, result.reason
        except Exception as error:  # noqa: BLE001 - a run that breaks is a result: its events tell what happened
            run.status, run.reason = "raised", f"{type(error).__name__}: {error}"
            run.errors.append(traceback.format_exc(limit=6))
        run.errors += replacements.errors
        run.nodes_brought_back = {"nodes": replacements.added, "seconds": round(replacements.seconds, 3)}
        if (run_dir / "events.jsonl").exists():
            run.events = read_events(run_dir / "events.jsonl")
        if schedule:
            run.invariants = invariant_report(run, run_dir, config, uri, s3, reference_losses)
    finally:
        nodes.close()
    return run


def invariant_report(run: MeshpilotRun, run_dir: Path, config, uri: str, s3, reference_losses):
    from checkpointing.storage import open_storage
    from orchestrator.analysis.invariants import check_run, ray_leftovers
    from orchestrator.driver.sample_ledger import LEDGER_FILE, read_ledger

    ledger_path = run_dir / LEDGER_FILE
    storage = open_storage(uri, endpoint_url=s3.endpoint_url)
    try:
        return check_run(
            run.events,
            steps=config.training.steps,
            reference_losses=reference_losses,
            ledger=read_ledger(ledger_path) if ledger_path.exists() else [],
            global_batch=config.training.global_batch,
            storage=storage,
            leftovers=lambda: ray_leftovers(storage),
        )
    except Exception:  # noqa: BLE001 - reported as the run's error, with the figures that could be made
        run.errors.append(f"invariant report: {traceback.format_exc(limit=6)}")
        return None
    finally:
        storage.close()


def losses(events: list[dict[str, Any]]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e["event"] == "step" and e.get("loss") is not None}


# ------------------------------------------------------------------ Ray Train
class NodeFaultsForReference:
    """Driver, ``run_reference``'s watcher thread: removes the node of each node fault's rank once
    every worker of the running attempt completed the fault's step, once; keeps when."""

    def __init__(self, nodes: WorkerNodes, faults: list[dict[str, Any]]) -> None:
        self.nodes = nodes
        self.pending = [fault for fault in faults if fault["kind"] == "node"]
        self.fired: list[tuple[dict[str, Any], float]] = []
        self.errors: list[str] = []

    def __call__(self, records: list[dict[str, Any]]) -> None:
        attempt = max((r["attempt"] for r in records if r["kind"] == "start"), default=1)
        for fault in list(self.pending):
            done = {
                r["rank"]
                for r in records
                if r["kind"] == "step" and r["attempt"] == attempt and r["step"] == fault["step"]
            }
            if len(done) < WORLD_SIZE:
                continue
            self.pending.remove(fault)
            # The rank's own records are in order: its last start says where it runs now.
            node_id = next(r["node"] for r in reversed(records) if r["kind"] == "start" and r["rank"] == fault["rank"])
            removed_at = time.time()
            try:
                self.nodes.remove(node_id)  # Cluster.remove_node needs no main thread
            except Exception:  # noqa: BLE001 - reported; the run goes on
                self.errors.append(f"removing the node of {describe_fault(fault)}: {traceback.format_exc(limit=3)}")
            else:
                self.fired.append((fault, removed_at))


def run_ray_train(cluster, workdir: Path, *, steps: int, applied: list[dict[str, Any]]) -> dict[str, Any]:
    """Ray Train V2 training the same job under ``applied`` (kill, raise and node faults)."""
    from bench.support.recovery_reference import all_records, run_reference
    from orchestrator.driver.train_spec import data_bytes, train_spec

    config = job_config(steps)  # the reference checkpoints on its own, to local disk
    in_workers = [fault for fault in applied if fault["kind"] != "node"]
    nodes = worker_nodes(cluster, 2 + sum(1 for fault in applied if fault["kind"] == "node"))
    node_faults = NodeFaultsForReference(nodes, applied)
    errors: list[str] = []
    started = time.time()
    try:
        run_reference(
            spec=train_spec(config, backend="gloo"),
            mesh=MESH,
            data=data_bytes(config) or b"",
            workdir=workdir,
            checkpoint_every=CHECKPOINT_EVERY,
            faults=in_workers,
            max_failures=2 * len(applied) + 1,  # the budget is not what is measured
            resources_per_worker=REFERENCE_RESOURCES,
            on_step=node_faults if node_faults.pending else None,
        )
    except Exception:  # noqa: BLE001 - the reference failing is reported, not hidden
        errors.append(traceback.format_exc(limit=4))
    finally:
        wall_s = time.time() - started
        nodes.close()
    records = all_records(workdir / "records")
    fired = [(in_workers[r["fault"]], r["time"]) for r in records if "fault" in r] + node_faults.fired
    completed = {r["step"] for r in records if r["kind"] == "step"}
    return {
        "finished": steps in completed and not errors,
        "fired": len(fired),
        "restarts": reference_restarts(records, fired, world_size=WORLD_SIZE),
        "goodput": reference_goodput(records, wall_s=wall_s, world_size=WORLD_SIZE),
        "losses": last_losses(records),
        "errors": errors + node_faults.errors,
    }


def last_losses(records: list[dict[str, Any]]) -> dict[int, float]:
    """Per step, the mean of the workers' slice losses in the last attempt every worker completed it."""
    by_attempt: dict[tuple[int, int], list[float]] = {}
    for record in records:
        if record["kind"] == "step" and record["loss"] is not None:
            by_attempt.setdefault((record["attempt"], record["step"]), []).append(record["loss"])
    last = {}
    for (_, step), values in sorted(by_attempt.items()):
        if len(values) == WORLD_SIZE:
            last[step] = sum(values) / WORLD_SIZE
    return last


# ------------------------------------------------------------------ the runs
def run_all(cluster, s3, workdir: Path, *, steps: int, schedule, seed: int):
    """The uninterrupted run, the chaos run, then Ray Train under the faults it meets (or None)."""
    started = time.monotonic()
    print("[1/3] meshpilot, uninterrupted", flush=True)
    uninterrupted = run_meshpilot(cluster, s3, workdir / "uninterrupted", steps=steps)
    print(f"      {uninterrupted.status} ({time.monotonic() - started:.0f} s)", flush=True)
    reference_losses = losses(uninterrupted.events) if uninterrupted.exit_code == 0 else None
    print(f"[2/3] meshpilot under chaos seed {seed}: {len(schedule)} faults", flush=True)
    chaos = run_meshpilot(
        cluster, s3, workdir / "chaos", steps=steps, schedule=schedule, seed=seed, reference_losses=reference_losses
    )
    survived = "survived" if chaos.survived else "DID NOT SURVIVE"
    print(f"      {chaos.status}, {survived} ({time.monotonic() - started:.0f} s)", flush=True)
    applied, _ = split_for_reference(schedule)
    ray_train = None
    if applied:
        print(f"[3/3] Ray Train V2 under {' '.join(map(describe_fault, applied))}", flush=True)
        ray_train = run_ray_train(cluster, workdir / "ray-train", steps=steps, applied=applied)
        print(f"      finished: {ray_train['finished']} ({time.monotonic() - started:.0f} s)", flush=True)
    return uninterrupted, chaos, ray_train


# ------------------------------------------------------------------ the report
def summarize(uninterrupted: MeshpilotRun, chaos: MeshpilotRun, ray_train, *, schedule, steps: int) -> dict[str, Any]:
    figures = chaos_figures(
        chaos.events, scheduled=len(schedule), survived=chaos.survived, uninterrupted=uninterrupted.events or None
    )
    report = chaos.invariants
    return {
        "run": {"status": chaos.status, "exit_code": chaos.exit_code, "reason": chaos.reason},
        "uninterrupted_run": {"status": uninterrupted.status, "exit_code": uninterrupted.exit_code},
        **figures,
        "nodes_brought_back": chaos.nodes_brought_back,
        "invariants": (
            [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in report.checks] if report is not None else None
        ),
        "goals_met": goals(figures, survived=chaos.survived),
        "ray_train": ray_train_summary(schedule, ray_train, losses(uninterrupted.events)),
        "errors": uninterrupted.errors + chaos.errors + (ray_train["errors"] if ray_train else []),
    }


def ray_train_summary(schedule, outcome: dict[str, Any] | None, uninterrupted_losses: dict[int, float]):
    applied, not_applied = split_for_reference(schedule)
    if outcome is None:
        why = "the schedule has no kill, raise or node fault at a step, the kinds Ray Train meets as given"
        return {"applies": False, "why": why, "not_applied": not_applied}
    restarts = outcome["restarts"]
    lost = [r["lost_steps"] for r in restarts if r["lost_steps"] is not None]
    times = [r["restart_s"] for r in restarts if r["restart_s"] is not None]
    common = sorted(set(outcome["losses"]) & set(uninterrupted_losses))
    parity = max((abs(outcome["losses"][s] / uninterrupted_losses[s] - 1) for s in common), default=None)
    return {
        "applies": True,
        "compared": (
            f"{len(applied)} of the schedule's {len(schedule)} faults, at the same steps and ranks; "
            "meshpilot's figures are under all of them"
        ),
        "faults": [describe_fault(fault) for fault in applied],
        "not_applied": not_applied,
        "fired": outcome["fired"],
        "finished": outcome["finished"],
        "restarts": restarts,
        "lost_steps_total": sum(lost),
        "slowest_restart_s": max(times, default=None),
        "goodput": outcome["goodput"],
        "loss_parity_max_rel_diff_vs_uninterrupted": parity,
    }


def breakdown(parts: dict[str, Any] | None) -> str:
    """``time_breakdown``'s parts in one line: '154 s steps, 16 s start, ...'."""
    if not parts:
        return "-"
    names = {
        "useful_s": "steps",
        "redone_s": "redone",
        "start_s": "start",
        "hang_wait_s": "hang waits",
        "recovery_s": "recoveries",
        "between_steps_s": "between steps",
        "end_s": "end",
    }
    return ", ".join(f"{parts[key]:.0f} s {name}" for key, name in names.items())


def print_table(summary: dict[str, Any], *, steps: int) -> None:
    def pct(value) -> str:
        return "-" if value is None else f"{value:.1%}"

    landed, lost, good = summary["faults_landed"], summary["steps_lost"], summary["goodput"]
    base, ratio, slowest = summary["uninterrupted_goodput"], summary["goodput_ratio_vs_uninterrupted"], None
    if summary["slowest_recovery"]:
        slowest = f"{summary['slowest_recovery']['mttr_s']:.2f} s ({summary['slowest_recovery']['cause']})"
    survived, run, back = summary["faults_survived"], summary["run"], summary["nodes_brought_back"]
    run_end = "finished, an invariant failed" if run["exit_code"] == 0 else f"run {run['status']}: {run['reason']}"
    kinds = ", ".join(f"{kind} {count}" for kind, count in landed["by_kind"].items())
    rows: list[tuple[str, ...]] = [
        ("figure", "meshpilot under chaos", "reference", "goal"),
        ("faults scheduled", f"{summary['faults_scheduled']} in {steps} steps", "", ""),
        ("faults landed (failure + drain events)", f"{landed['total']} ({kinds})", "", ""),
        ("saves given up on storage", str(landed["saves_failed_on_storage"]), "", ""),
        ("faults survived", f"all {survived}" if survived is not None else f"NO: {run_end}", "", "all"),
        ("steps lost, a replica survived", str(lost["replica_survived"]), "", "0"),
        ("steps lost, restored from peer memory", str(lost["from_peer_memory"]), "", "0"),
        (
            "steps lost, restored from storage",
            f"{lost['from_storage']} (step events: {lost['redone_after_restores']} redone)",
            "",
            "",
        ),
        (
            "restores from peer memory / storage",
            f"{summary['restores_from_peer_memory']} / {summary['restores_from_storage']}",
            "",
            "",
        ),
        (
            "goodput (time in counted steps / wall)",
            pct(good["goodput"]),
            f"uninterrupted {pct(base and base['goodput'])}, ratio {'-' if ratio is None else f'{ratio:.2f}x'}",
            f">= {GOODPUT_GOAL:.0%}",
        ),
        ("slowest recovery (mttr_s)", slowest or "-", "", ""),
        ("nodes brought back (driver waited)", f"{back.get('nodes')} ({back.get('seconds')} s)", "", ""),
        ("where the wall time went", breakdown(summary["time_breakdown"]), "", ""),
        ("  the same, uninterrupted", breakdown(summary["uninterrupted_time_breakdown"]), "", ""),
    ]
    rows += ray_train_rows(summary["ray_train"], lost["total"], good["goodput"], pct)
    print(table(rows))
    if summary["ray_train"]["not_applied"]:
        print("not applied to Ray Train V2:")
        for fault, why in summary["ray_train"]["not_applied"].items():
            print(f"  {fault}: {why}")
    print("\ninvariants:")
    for check in summary["invariants"] or [{"name": "(no report)", "ok": False, "detail": "see errors"}]:
        print(f"  {'PASS' if check['ok'] else 'FAIL'} {check['name']:<12} {check['detail']}")
    print("\ngoals:")
    for goal, met in summary["goals_met"].items():
        print(f"  {goal}: {'-' if met is None else 'met' if met else 'MISSED'}")


def ray_train_rows(ray_train: dict[str, Any], ours_lost: int, ours_goodput, pct) -> list[tuple[str, ...]]:
    if not ray_train["applies"]:
        return [("Ray Train V2", "", f"not compared: {ray_train['why']}", "")]
    restarts = ", ".join("-" if r["restart_s"] is None else f"{r['restart_s']:.1f} s" for r in ray_train["restarts"])
    return [
        ("Ray Train V2, same faults where they apply", "", f"{' '.join(ray_train['faults'])}", ""),
        ("  restart: fault -> first step, each", "", restarts, ""),
        ("  steps lost (ours: under every fault)", str(ours_lost), str(ray_train["lost_steps_total"]), ""),
        (
            "  goodput (ours: under every fault)",
            pct(ours_goodput),
            f"{pct(ray_train['goodput']['goodput'])} under {len(ray_train['faults'])} faults",
            "",
        ),
    ]


def start_separate_networks(stack: contextlib.ExitStack):
    """The separate-network cluster (head only: each run adds its nodes) and an S3 server on its
    bridge, where the nodes' namespaces reach it; both closed by ``stack``."""
    from bench.recovery import HEAD_CPUS
    from checkpointing.local_s3 import LocalS3Server
    from tests.fixtures.netns_nodes import NetnsCluster

    s3 = LocalS3Server()  # its keys exist now; it listens once the bridge does
    os.environ.update(s3.env())
    cluster = NetnsCluster(0, head_cpus=HEAD_CPUS, env=s3.env())
    stack.callback(cluster.close)
    s3.host = cluster.head_address
    stack.enter_context(s3)
    return cluster, s3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK['steps']} steps, {QUICK['faults']} faults")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"the chaos seed (default {DEFAULT_SEED})")
    parser.add_argument("--faults", type=int, default=None, help=f"faults to draw (default {FULL['faults']})")
    parser.add_argument("--steps", type=int, default=None, help=f"steps of the run (default {FULL['steps']})")
    parser.add_argument("--keep", type=Path, default=None, help="keep every run's directory here")
    parser.add_argument(
        "--separate-networks",
        action="store_true",
        help="worker nodes in network namespaces of their own (root); partitions and slow links drawn too",
    )
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    steps, count = args.steps or size["steps"], args.faults or size["faults"]
    import ray

    from bench.recovery import start_cluster
    from checkpointing.local_s3 import LocalS3Server
    from orchestrator.driver.chaos import chaos_kinds, chaos_schedule

    kinds = chaos_kinds(storage=True, nodes=True, network=args.separate_networks)
    schedule = chaos_schedule(
        args.seed, count, steps=steps, world_size=WORLD_SIZE, replica_size=REPLICA_SIZE, kinds=kinds
    )
    print(f"chaos soak: {WORLD_SIZE} ranks {MESH}, debug model, seq_len {SEQ_LEN}, {steps} steps", flush=True)
    print(f"seed {args.seed}, {count} faults: {' '.join(fault.describe() for fault in schedule)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="meshpilot-chaos-") as tmp, contextlib.ExitStack() as stack:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if args.separate_networks:
            cluster, s3 = start_separate_networks(stack)
        else:
            s3 = stack.enter_context(LocalS3Server())
            os.environ.update(s3.env())  # before the cluster starts: its raylets and ranks inherit them
            cluster = start_cluster()
        try:
            uninterrupted, chaos, ray_train = run_all(
                cluster, s3, workdir, steps=steps, schedule=schedule, seed=args.seed
            )
        finally:
            ray.shutdown()
            cluster.shutdown()
    summary = summarize(uninterrupted, chaos, ray_train, schedule=schedule, steps=steps)
    print()
    print_table(summary, steps=steps)
    emit(
        {
            "benchmark": "chaos",
            "quick": args.quick,
            "seed": args.seed,
            "steps": steps,
            "faults": count,
            "steps_per_fault": round(steps / count, 1),
            "schedule": [fault.describe() for fault in schedule],
            "world_size": WORLD_SIZE,
            "mesh": MESH,
            "model": "debug",
            "seq_len": SEQ_LEN,
            "global_batch": 16,
            "checkpoint_every": CHECKPOINT_EVERY,
            "spare_actors": SPARE_ACTORS,
            "reference": (
                f"Ray Train V2 TorchTrainer (ray {ray.__version__}): the same Trainer, layout, data and batch, "
                f"a checkpoint every {CHECKPOINT_EVERY} steps to local disk, restarting the group on each fault"
            ),
            **summary,
        }
    )
    return 0 if chaos.survived and not summary["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
