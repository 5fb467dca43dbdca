"""preStop hook of meshpilot's Ray worker pods: tell Ray this node is going, wait until its ranks have left.

Runs inside the Ray container of a worker pod that Kubernetes is terminating (spot reclaim,
autoscaler scale-down, node drain), before the container gets SIGTERM:

    python /etc/meshpilot/hooks/drain_node.py --grace-seconds 90

``--grace-seconds`` must equal the pod's ``terminationGracePeriodSeconds`` (the manifests' tests
check it): the hook and the SIGTERM that follows share that budget.

The contract with meshpilot's driver (the elastic side reads the same GCS state):

1. This hook finds the pod's Ray node (the ALIVE node whose hostname is this pod's hostname
   or whose address is its IP; ``--node-id`` overrides) and asks the GCS to drain it with reason
   ``DRAIN_NODE_REASON_PREEMPTION``, message ``pod <hostname> terminating``, and deadline
   ``now + grace - margin`` (unix ms). Ray places nothing new on a draining node.
2. The driver sees the node in ``GcsClient.get_draining_nodes()`` (``{node_id_hex: deadline_ms}``,
   also ``ray._private.state.state.get_draining_nodes()``), marks the replica groups with ranks
   there as draining, and at the next step boundary shrinks the mesh without them (emergency
   checkpoint first when only one replica is left), then ends those rank actors.
3. With its last actor gone the drained raylet exits by itself; the GCS marks the node DEAD with
   death reason ``AUTOSCALER_DRAIN_PREEMPTED`` (a planned departure, not a failure). The hook
   sees that and returns, so the container's SIGTERM finds nothing left to lose. If the driver
   does not act before the deadline the hook returns anyway and the ordinary failure path
   (drop the replica group, or restore from the last checkpoint) takes over.

The GCS address comes from ``RAY_ADDRESS``, which KubeRay sets in every Ray container, and the
token from ``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN``, which KubeRay sets when ``authOptions.mode`` is
``token``. The hook always exits 0 (Kubernetes terminates the pod either way) and says what
happened on stderr, where ``kubectl describe pod`` shows a failing hook's output.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time

POLL_INTERVAL_S = 0.5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Drain this pod's Ray node and wait for its ranks to leave.")
    parser.add_argument("--grace-seconds", type=float, required=True,
                        help="the pod's terminationGracePeriodSeconds")
    parser.add_argument("--margin-seconds", type=float, default=15.0,
                        help="time kept back for SIGTERM and Ray's own shutdown (default 15)")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                        help="GCS address host:port (default: RAY_ADDRESS, set by KubeRay)")
    parser.add_argument("--node-id", help="hex id of the node to drain (default: this pod's node)")
    args = parser.parse_args(argv)

    started = time.time()
    deadline = started + max(args.grace_seconds - args.margin_seconds, 1.0)
    # A hook must not outlive its budget, even while a GCS call blocks in C++: a watchdog thread
    # ends the process at the deadline whatever the main thread is doing.
    watchdog = threading.Timer(deadline - time.time(), _give_up, args=(started,))
    watchdog.daemon = True
    watchdog.start()
    if not args.address:
        _say("no GCS address (RAY_ADDRESS is unset and --address not given); not draining")
        return 0
    try:
        return _drain_and_wait(args.address, args.node_id, deadline, started)
    except Exception as error:  # a hook that fails only delays the pod; say why and let it go
        _say(f"drain failed: {type(error).__name__}: {error}")
        return 0


def _drain_and_wait(address: str, node_id: str | None, deadline: float, started: float) -> int:
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2, gcs_pb2

    gcs = GcsClient(address=address)
    hostname = socket.gethostname()
    if node_id is None:
        node_id = _this_node(gcs, hostname, gcs_pb2.GcsNodeInfo.ALIVE)
        if node_id is None:
            return 0
    accepted, rejection = gcs.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        f"pod {hostname} terminating",
        int(deadline * 1000),
    )
    if not accepted:
        _say(f"the GCS refused to drain node {node_id}: {rejection}")
        return 0
    _say(f"node {node_id} draining; its ranks have until {time.strftime('%H:%M:%S', time.gmtime(deadline))} UTC to leave")
    while time.time() < deadline:
        info = gcs.get_all_node_info().get(_node_key(node_id))
        if info is None or info.state == gcs_pb2.GcsNodeInfo.DEAD:
            _say(f"node {node_id} has left the cluster after {time.time() - started:.1f} s")
            return 0
        time.sleep(POLL_INTERVAL_S)
    _give_up(started)
    return 0


def _this_node(gcs, hostname: str, alive: int) -> str | None:
    try:
        pod_ip = socket.gethostbyname(hostname)
    except OSError:
        pod_ip = None
    matches = [node_key.hex() for node_key, info in gcs.get_all_node_info().items()
               if info.state == alive and (info.node_manager_hostname == hostname or info.node_manager_address == pod_ip)]
    if len(matches) != 1:
        found = "no" if not matches else f"{len(matches)}"
        _say(f"{found} ALIVE Ray node(s) match this pod ({hostname}, {pod_ip}); pass --node-id; not draining")
        return None
    return matches[0]


def _node_key(node_id: str):
    from ray import NodeID

    return NodeID.from_hex(node_id)


def _give_up(started: float) -> None:
    _say(f"deadline reached after {time.time() - started:.1f} s; leaving the rest to SIGTERM")
    sys.stderr.flush()
    os._exit(0)


def _say(message: str) -> None:
    print(f"meshpilot drain hook: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
