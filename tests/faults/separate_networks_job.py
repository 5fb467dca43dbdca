"""One job on separate-network nodes, run in a process of its own (it starts and owns its Ray cluster).

    sudo python -m tests.faults.separate_networks_job RUN_DIR --steps 16 --inject partition@6:1:6 --reference

The session test cluster's head listens on loopback, which no other network namespace reaches, and
a process holds one Ray connection: so the separate-network cluster (tests/fixtures/netns_nodes.py)
gets its own process, started by tests/faults/test_separate_networks.py. It runs, on two worker
nodes each in its own namespace, the fault harness's elastic layout (two replica groups of two
ranks, one per node), optionally the uninterrupted job first (``--reference``: its losses are the
ones to match), then the job with the faults. It writes ``RUN_DIR/summary.json``:

    exit_code, reason           the faulted run's end
    reference_losses            {step: loss} of the uninterrupted run (with --reference)
    network_faults              [{kind, node, seconds, mbit, fired_at}]: when each was carried out
    healed_at                   when each partitioned node's link came back up ({node: time})
    old_rank_pids               the rank processes on a partitioned node when it was cut off
    old_ranks_alive_after_heal  those still alive ``AFTER_HEAL_S`` after its heal (must be none)
    ranks_at_grow               {node: rank processes there} when the mesh grew back (the healed node reused)
    leftovers                   rank actors or placement groups the run left (must be none)

A bad ``--inject`` (malformed, a node the cluster lacks, a partition with one node, netem without
the kernel's module) is one line on stderr and exit code 2, before any cluster starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

from orchestrator.errors import UserError
from workers.faults import NETWORK_KINDS, FaultKind, FaultSpec, NetworkFault

# Two replica groups of two ranks (tests/faults/harness.py ELASTIC_LAYOUT), one per worker node,
# each node with room for one group only: a group lost with its node can come back only there.
NODES = 2
RANKS_PER_NODE = 2
OVERRIDES = (
    "parallelism.dp_replicate=2",
    "parallelism.dp_shard=2",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "training.seq_len=32",
    "elastic.hang_timeout_s=8",
    "elastic.heartbeat_timeout_s=10",
    "metrics.enabled=false",
    "data.record_samples=true",
)
# How long after a heal the partitioned node's old rank processes must be gone.
AFTER_HEAL_S = 5.0


def check_faults(faults: tuple[FaultSpec, ...], *, nodes: int, netem: bool) -> None:
    """Refuse network faults this cluster cannot carry out: ``UserError`` in one line."""
    for fault in faults:
        if fault.kind not in NETWORK_KINDS:
            continue
        if fault.rank >= nodes:
            raise UserError(f"--inject {fault.describe()}: no worker node {fault.rank}; the nodes are 0 to {nodes - 1}")
        if fault.kind == FaultKind.PARTITION and nodes < 2:
            raise UserError(
                f"--inject {fault.describe()}: a partition needs at least two worker nodes (one to recover on)"
            )
        if fault.kind == FaultKind.NETEM and not netem:
            raise UserError(
                f"--inject {fault.describe()}: netem needs the kernel's sch_netem module, which this machine lacks; "
                "use throttle@STEP:NODE:MBIT for a slow link"
            )


def parse(argv: list[str]) -> tuple[argparse.Namespace, tuple[FaultSpec, ...]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=NODES)
    parser.add_argument("--inject", action="append", default=[])
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--set", action="append", default=[], help="more config overrides")
    args = parser.parse_args(argv)
    try:
        faults = tuple(FaultSpec.parse(text) for text in args.inject)
    except ValueError as error:
        raise UserError(str(error)) from None
    return args, faults


class FaultRecorder:
    """The driver's network-fault callable: carries a fault out on the cluster and notes when;
    for a partition, notes the node's rank processes, and checks they are gone after the heal."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.fired: list[dict] = []
        self.healed_at: dict[int, float] = {}
        self.old_rank_pids: dict[int, list[int]] = {}
        self.alive_after_heal: dict[int, list[int]] = {}
        self.checks: list[threading.Thread] = []
        self.ranks_at_grow: dict[int, list[int]] = {}

    def on_event(self, event: dict) -> None:
        """An event subscriber: where the rank processes are when the mesh grows back."""
        if event["event"] == "grow" and not self.ranks_at_grow:
            self.ranks_at_grow = {node.index: rank_pids(node.namespace) for node in self.cluster.nodes}

    def __call__(self, fault: NetworkFault) -> None:
        if fault.kind == "partition":
            self.old_rank_pids[fault.node] = rank_pids(self.cluster.node(fault.node).namespace)
        self.cluster.apply(fault)
        self.fired.append({"kind": str(fault.kind), "node": fault.node, "seconds": fault.seconds, "mbit": fault.mbit})
        self.fired[-1]["fired_at"] = time.time()
        if fault.kind == "partition":
            check = threading.Thread(target=self._after_heal, args=(fault.node, fault.seconds), daemon=True)
            check.start()
            self.checks.append(check)

    def _after_heal(self, node: int, seconds: float) -> None:
        time.sleep(seconds)
        self.healed_at[node] = time.time()
        time.sleep(AFTER_HEAL_S)
        import psutil

        self.alive_after_heal[node] = [pid for pid in self.old_rank_pids[node] if psutil.pid_exists(pid)]


def rank_pids(namespace: str) -> list[int]:
    """The rank actor processes running in ``namespace``."""
    import subprocess

    import psutil

    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            if "RankActor" in " ".join(psutil.Process(int(pid)).cmdline()):
                found.append(int(pid))
        except psutil.NoSuchProcess:
            pass
    return found


def main(argv: list[str]) -> int:
    from tests.fixtures.netns_nodes import NetnsCluster, available, netem_available

    try:
        args, faults = parse(argv)
        check_faults(faults, nodes=args.nodes, netem=netem_available())
        reason = available()
        if reason is not None:
            raise UserError(reason)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    from orchestrator.analysis.invariants import ray_leftovers
    from tests.faults.harness import ON_WORKER_NODES, run_job
    from tests.jobs import losses

    args.run_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {"started_at": time.time()}
    cluster = NetnsCluster(args.nodes, ranks_per_node=RANKS_PER_NODE, log_dir=args.run_dir / "ray-start")
    summary["cluster_up_at"] = time.time()
    try:
        overrides = (*OVERRIDES, ON_WORKER_NODES, f"training.steps={args.steps}", *args.set)
        if args.reference:
            result, events = run_job(args.run_dir / "reference", *overrides)
            summary["reference_exit_code"] = result.exit_code
            summary["reference_losses"] = losses(events)
        recorder = FaultRecorder(cluster)
        result, _ = run_job(
            args.run_dir / "run",
            *overrides,
            faults=tuple(f.describe() for f in faults),
            network_fault=recorder,
            on_event=recorder.on_event,
        )
        for check in recorder.checks:
            check.join()
        summary.update(
            exit_code=result.exit_code,
            reason=result.reason,
            network_faults=recorder.fired,
            healed_at=recorder.healed_at,
            old_rank_pids=recorder.old_rank_pids,
            old_ranks_alive_after_heal=recorder.alive_after_heal,
            ranks_at_grow=recorder.ranks_at_grow,
            nodes_alive={node.index: node.node_id for node in cluster.nodes},
            leftovers=ray_leftovers(),
        )
    finally:
        cluster.close()
        (args.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
