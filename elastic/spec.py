"""The device-mesh arithmetic: one object owns it, nothing else recomputes ranks by hand.

Pure values (no ray, no torch), imported by the driver and by the ranks alike.

Rank order, outermost to innermost, is ``DIM_ORDER = (dp_replicate, pp, dp_shard, cp, tp)``:

* ``tp`` is innermost, so a tensor-parallel group is a block of consecutive ranks and is
  placed inside one node; ``cp`` (context parallel: the sequence split over ranks, whose
  attention all-gathers keys and values every layer) sits next to it, as in TorchTitan's
  ``(pp, dp_replicate, dp_shard, cp, tp)``, so the two chattiest groups stay closest;
* a replica group (one ``dp_replicate`` slice, one whole copy of the model state) is a
  contiguous block of ``pp * dp_shard * cp * tp`` ranks: it is the unit that fails, is dropped
  and is added back, and dropping one renumbers the survivors without moving any shard. This is
  why ``dp_replicate`` stays outermost here, where TorchTitan puts ``pp`` first.

``BatchPlan`` owns the batch arithmetic the same way: how a step's global batch splits over the
data-parallel ranks, into microbatches, and over gradient-accumulation rounds on a smaller mesh.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

DIM_ORDER: tuple[str, ...] = ("dp_replicate", "pp", "dp_shard", "cp", "tp")


class CpMethod(StrEnum):
    """How attention is made whole over the cp ranks that split every sequence
    (``parallelism.cp_method``; the rank side: ``workers.context_parallel``).

    ``allgather``: every rank gathers the whole sequence's keys and values (Llama 3).
    ``ring``: key/value blocks pass around the cp ring beside the attention on the block held,
    partial results merged by log-sum-exp; a rank never holds more than two blocks.
    ``ulysses``: an all-to-all trades the sequence split for a head split, attention runs over
    the whole sequence for heads / cp heads, and a second all-to-all trades back.
    """

    ALLGATHER = "allgather"
    RING = "ring"
    ULYSSES = "ulysses"


def ulysses_heads_problem(*, n_heads: int, n_kv_heads: int, tp: int, cp: int) -> str | None:
    """Why Ulysses cannot split a model's heads over ``cp`` ranks after ``tp`` took its share, or
    None when it can: the query heads per tp rank must divide by cp; the key/value heads per tp
    rank must too, or divide cp (then each is repeated for the cp ranks whose queries use it)."""
    q_heads, kv_heads = n_heads // tp, n_kv_heads // tp
    if q_heads % cp:
        return f"model.n_heads={n_heads} / tp={tp} = {q_heads} query heads do not split over cp={cp}"
    if kv_heads % cp and cp % kv_heads:
        return (
            f"model.n_kv_heads={n_kv_heads} / tp={tp} = {kv_heads} key/value heads neither split over "
            f"cp={cp} nor divide it"
        )
    return None


def cp_method_on_mesh(method: CpMethod, *, n_heads: int, n_kv_heads: int, tp: int, cp: int) -> CpMethod:
    """The method a mesh runs: ``method``, or ``allgather`` where Ulysses cannot split the heads
    over this mesh's cp. The config check refuses such a cp up front; this covers a mesh the
    driver chose later (a restore onto fewer ranks than a tp x pp x cp group may change cp; an
    in-place shrink never does). Every method gives the same numbers, so the run goes on."""
    if cp == 1 or method is not CpMethod.ULYSSES:
        return method
    if ulysses_heads_problem(n_heads=n_heads, n_kv_heads=n_kv_heads, tp=tp, cp=cp) is None:
        return method
    return CpMethod.ALLGATHER


class MeshError(ValueError):
    """An impossible mesh; the message names every degree and what it must divide."""


def samples_per_rank(global_batch: int, dp: int) -> int:
    """Samples each of ``dp`` data-parallel ranks takes of a step's ``global_batch``."""
    return global_batch // dp


@dataclass(frozen=True)
class BatchPlan:
    """How one step's ``global_batch`` samples are split: ``dp`` ranks x ``microbatches`` forward
    passes of ``microbatch_size`` samples x accumulation rounds.

    The microbatch size is fixed from the configured mesh (``for_mesh``); a smaller mesh keeps it
    and runs more rounds, so the global batch, and with it the loss, stays the same.
    """

    global_batch: int
    microbatch_size: int
    microbatches: int = 1

    @classmethod
    def for_mesh(cls, global_batch: int, *, dp: int, microbatches: int) -> BatchPlan:
        """The configured mesh's plan: one round per step."""
        return cls(
            global_batch=global_batch, microbatch_size=global_batch // (dp * microbatches), microbatches=microbatches
        )

    @property
    def rank_round_samples(self) -> int:
        """Samples one data-parallel rank takes per accumulation round."""
        return self.microbatches * self.microbatch_size

    def round_samples(self, dp: int) -> int:
        """Samples all ``dp`` data-parallel ranks take together per accumulation round."""
        return dp * self.rank_round_samples

    def fits(self, dp: int) -> bool:
        """Whether ``dp`` data-parallel ranks can take the global batch in whole rounds."""
        return self.global_batch % self.round_samples(dp) == 0

    def accumulation(self, dp: int) -> int:
        """Forward/backward rounds per step so that dp * microbatches * size * rounds = global_batch."""
        rounds, remainder = divmod(self.global_batch, self.round_samples(dp))
        if remainder or rounds < 1:
            raise ValueError(
                f"global_batch={self.global_batch} is not a multiple of dp={dp} x microbatches="
                f"{self.microbatches} x microbatch_size={self.microbatch_size}"
            )
        return rounds

    def samples_per_rank(self, dp: int) -> int:
        """Samples each data-parallel rank takes of one step."""
        return samples_per_rank(self.global_batch, dp)


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in the mesh."""

    dp_replicate: int
    pp: int
    dp_shard: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class ReplicaGroup:
    """The ranks of one ``dp_replicate`` slice: one whole copy of the model state."""

    index: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class MeshSpec:
    """Degrees of the five parallel dimensions; their product is the world size.

    ``cp`` (context parallel) splits every sequence over ranks that take the same samples; it is
    last so that meshes written before it existed keep their positional meaning.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        bad = [
            f"{name}={getattr(self, name)!r}"
            for name in DIM_ORDER
            if not isinstance(getattr(self, name), int)
            or isinstance(getattr(self, name), bool)
            or getattr(self, name) < 1
        ]
        if bad:
            raise MeshError(f"mesh degrees must be integers >= 1, got {', '.join(bad)}")

    # ----------------------------------------------------------------- sizes
    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.pp * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways each global batch is split (cp ranks share samples)."""
        return self.dp_replicate * self.dp_shard

    @property
    def replica_size(self) -> int:
        """Ranks in one replica group."""
        return self.pp * self.dp_shard * self.cp * self.tp

    @property
    def fsdp_shards(self) -> int:
        """Ranks one stage's parameters are sharded over in a replica group: dp_shard x cp
        (TorchTitan's ``dp_shard_cp``), so gradients are averaged over the cp ranks too."""
        return self.dp_shard * self.cp

    @property
    def shape(self) -> tuple[int, ...]:
        """Degrees in ``DIM_ORDER``; the shape of the DeviceMesh the ranks build."""
        return tuple(getattr(self, name) for name in DIM_ORDER)

    def check_world_size(self, world_size: int) -> None:
        """Raise ``MeshError`` naming every degree unless they multiply to ``world_size``."""
        if self.world_size != world_size:
            degrees = " x ".join(f"{name}={getattr(self, name)}" for name in DIM_ORDER)
            raise MeshError(f"{degrees} = {self.world_size} ranks, but the world has {world_size}")

    # ----------------------------------------------------------- rank maths
    def coords(self, rank: int) -> RankCoords:
        self._check_rank(rank)
        values = {}
        for name, degree in reversed(list(zip(DIM_ORDER, self.shape))):
            rank, values[name] = divmod(rank, degree)
        return RankCoords(**values)

    def rank(self, coords: RankCoords) -> int:
        rank = 0
        for name, degree in zip(DIM_ORDER, self.shape):
            value = getattr(coords, name)
            if not 0 <= value < degree:
                raise MeshError(f"coordinate {name}={value} outside 0..{degree - 1} in {self.describe()}")
            rank = rank * degree + value
        return rank

    def dp_rank(self, rank: int) -> int:
        """Index of this rank's slice of the global batch (0 .. dp-1)."""
        c = self.coords(rank)
        return c.dp_replicate * self.dp_shard + c.dp_shard

    def replica_groups(self) -> tuple[ReplicaGroup, ...]:
        size = self.replica_size
        return tuple(
            ReplicaGroup(index=i, ranks=tuple(range(i * size, (i + 1) * size))) for i in range(self.dp_replicate)
        )

    def replica_of(self, rank: int) -> int:
        return self.coords(rank).dp_replicate

    def stride(self, dim: str) -> int:
        """Rank distance between neighbours along ``dim``: the product of the inner degrees.

        A ``dim`` group spans ``stride(dim) * degree`` consecutive ranks; the planner uses it
        to tell which groups stay inside a node and which cross the network.
        """
        if dim not in DIM_ORDER:
            raise MeshError(f"unknown mesh dimension {dim!r}; known: {', '.join(DIM_ORDER)}")
        stride = 1
        for name in reversed(DIM_ORDER):
            if name == dim:
                return stride
            stride *= getattr(self, name)
        raise AssertionError("unreachable")

    def with_replicas(self, dp_replicate: int) -> MeshSpec:
        """The same layout with another number of replica groups (shrink or grow)."""
        return dataclasses.replace(self, dp_replicate=dp_replicate)

    # ------------------------------------------------------------ checking
    def check_divides(
        self,
        *,
        n_heads: int,
        n_kv_heads: int,
        n_layers: int,
        ffn_dim: int | None,
        global_batch: int,
        microbatches: int,
        seq_len: int,
        stages_per_rank: int = 1,
        even_stages: bool = True,
    ) -> list[str]:
        """Every way this mesh does not fit the model and batch, as readable sentences.

        Returns an empty list when the mesh fits; callers decide how to raise.
        ``even_stages=False`` accepts pipeline stages holding unequal numbers of layers (as
        Llama 3 ran 126 layers on 16 stages); there must still be a layer for every stage.
        ``ffn_dim`` is the MLP width tp splits (``ModelSpec.tp_split_ffn_dim``; None: none).
        """
        problems = []
        tp = self.tp
        for what, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("ffn_dim", ffn_dim)):
            if value is not None and value % tp:
                problems.append(f"tp={tp} must divide model.{what}={value}")
        if self.cp > 1 and seq_len % (2 * self.cp):
            problems.append(
                f"2 x cp={self.cp} = {2 * self.cp} must divide training.seq_len={seq_len} "
                "(each cp rank keeps two of 2 x cp equal chunks of every sequence)"
            )
        elif tp > 1 and (seq_len // self.cp) % tp:
            problems.append(
                f"tp={tp} must divide training.seq_len={seq_len} / cp={self.cp} = {seq_len // self.cp} "
                "(sequence parallel)"
            )
        stages = self.pp * stages_per_rank
        if not even_stages:
            if stages > n_layers:
                problems.append(
                    f"pp={self.pp} x stages_per_rank={stages_per_rank} = {stages} pipeline stages "
                    f"exceed model.n_layers={n_layers}"
                )
        elif n_layers % stages:
            problems.append(
                f"pp={self.pp} x stages_per_rank={stages_per_rank} = {stages} pipeline stages "
                f"must divide model.n_layers={n_layers}"
            )
        if global_batch % (self.dp * microbatches):
            problems.append(
                f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x microbatches="
                f"{microbatches} = {self.dp * microbatches} must divide training.global_batch={global_batch}"
            )
        return problems

    # ------------------------------------------------------------- display
    def describe(self) -> str:
        """Every degree in ``DIM_ORDER``; ``cp`` only when sequences are split (cp > 1)."""
        return " x ".join(f"{name}={getattr(self, name)}" for name in DIM_ORDER if name != "cp" or self.cp > 1)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DIM_ORDER}

    @classmethod
    def from_dict(cls, values: dict[str, int]) -> MeshSpec:
        """A mesh from ``as_dict``'s values; a dimension missing (``cp`` in a mesh written before
        it existed) has degree 1."""
        return cls(**{name: int(values.get(name, 1)) for name in DIM_ORDER})

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} outside 0..{self.world_size - 1} for {self.describe()}")
