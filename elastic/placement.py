"""Where replica groups go: spread over nodes (failure domains), tensor-parallel groups packed.

Pure: the driver passes the nodes it sees, this returns a preferred node per replica group.
Each replica group becomes one Ray placement group whose bundles are whole tensor-parallel
groups (a bundle never spans nodes, so TP traffic stays inside a node) with strategy PACK
(pipeline stages of a replica next to each other); the preferred node is a soft target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.spec import MeshSpec


@dataclass(frozen=True)
class NodeCapacity:
    node_id: str
    cpus: float
    gpus: float = 0.0
    custom: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RankResources:
    cpus: float
    gpus: float = 0.0
    # Custom resources (node pools, labels as resources), per rank.
    custom: dict[str, float] = field(default_factory=dict)

    def times(self, count: int) -> dict[str, float]:
        """Ray resource demand of ``count`` ranks."""
        demand = {"CPU": self.cpus * count}
        if self.gpus:
            demand["GPU"] = self.gpus * count
        demand.update({name: amount * count for name, amount in self.custom.items() if amount})
        return demand


def tp_bundles(mesh: MeshSpec, per_rank: RankResources) -> list[dict[str, float]]:
    """One bundle per tensor-parallel group of a replica group, in rank order."""
    return [per_rank.times(mesh.tp) for _ in range(mesh.replica_size // mesh.tp)]


def usable(nodes: list[NodeCapacity], per_rank: RankResources) -> list[NodeCapacity]:
    """Nodes that advertise every custom resource a rank needs."""
    return [
        n for n in nodes if all(n.custom.get(name, 0.0) >= amount for name, amount in per_rank.custom.items() if amount)
    ]


def shortfall(mesh: MeshSpec, per_rank: RankResources, nodes: list[NodeCapacity]) -> str | None:
    """Why the cluster cannot hold the mesh at all, or None. Checks totals and TP groups per node."""
    nodes = usable(nodes, per_rank)
    if per_rank.custom and not nodes:
        wanted = ", ".join(f"{name}={amount:g}" for name, amount in per_rank.custom.items())
        return f"no node offers the custom resources each rank needs ({wanted})"
    need_cpus = mesh.world_size * per_rank.cpus
    need_gpus = mesh.world_size * per_rank.gpus
    have_cpus = sum(n.cpus for n in nodes)
    have_gpus = sum(n.gpus for n in nodes)
    if need_cpus > have_cpus + 1e-9 or need_gpus > have_gpus + 1e-9:
        return (
            f"{mesh.world_size} ranks need {need_cpus:g} CPUs and {need_gpus:g} GPUs; "
            f"the cluster has {have_cpus:g} CPUs and {have_gpus:g} GPUs"
        )
    group_cpus, group_gpus = per_rank.cpus * mesh.tp, per_rank.gpus * mesh.tp
    groups_that_fit = sum(_fits(n, group_cpus, group_gpus) for n in nodes)
    tp_groups = mesh.world_size // mesh.tp
    if groups_that_fit < tp_groups:
        return (
            f"a tensor-parallel group of tp={mesh.tp} ranks needs {group_cpus:g} CPUs and {group_gpus:g} GPUs "
            f"on one node; the nodes can hold only {groups_that_fit} of the {tp_groups} groups"
        )
    return None


def spread_replicas(
    replicas: int, demand: RankResources, replica_size: int, nodes: list[NodeCapacity]
) -> list[str | None]:
    """A preferred node per replica group: each goes to the node with the most room left,
    so that losing one node takes out as few replica groups as possible."""
    nodes = usable(nodes, demand)
    free = {n.node_id: [n.cpus, n.gpus] for n in nodes}
    choice: list[str | None] = []
    need_cpus, need_gpus = demand.cpus * replica_size, demand.gpus * replica_size
    used_count: dict[str, int] = {n.node_id: 0 for n in nodes}
    for _ in range(replicas):
        candidates = [node for node, (cpus, gpus) in free.items() if cpus >= need_cpus and gpus >= need_gpus]
        if not candidates:
            choice.append(None)  # does not fit one node whole: let Ray pack it where it can
            continue
        best = min(candidates, key=lambda node: (used_count[node], -free[node][0], node))
        free[best][0] -= need_cpus
        free[best][1] -= need_gpus
        used_count[best] += 1
        choice.append(best)
    return choice


def _fits(node: NodeCapacity, cpus: float, gpus: float) -> int:
    if cpus <= 0 and gpus <= 0:
        return 10**9
    by_cpu = int(node.cpus // cpus) if cpus > 0 else 10**9
    by_gpu = int(node.gpus // gpus) if gpus > 0 else 10**9
    return min(by_cpu, by_gpu)
