"""Per-block ``torch.compile`` and the job's compile caches (``training.compile``).

Runs on every rank. Each transformer block is compiled on its own, as TorchTitan does: the
blocks of a model share one graph (their parameters are the graph's inputs), so a model of any
depth compiles one block's forward and backward, and FSDP2's hooks stay outside the graph
(they gather and free around each block's call). What makes compilation and elasticity agree:

- The inductor caches (FX graphs, AOTAutograd, Triton or C++ kernels) live in the job's cache
  directory (``TrainSpec.compile_cache_dir``), shared by every rank of the node and kept for the
  job's life: a restarted rank or one of a new generation loads graphs instead of compiling them.
- Process groups are named by the mesh layout while compiling (``workers/runtime.py``): a graph
  of a tensor-parallel block holds its groups' names, so a layout seen before produces the very
  graphs already in the cache.
- A rank that compiled a graph publishes the cache's artifacts
  (``torch.compiler.save_cache_artifacts``) on the job's store, under the layout; a rank joining
  a generation of that layout, on a node whose cache never saw it, loads them before it builds its
  trainer (``load_published_artifacts``): joiners, spares and restarted ranks compile nothing.
- Leaving a generation of a tensor- or context-parallel mesh drops dynamo's in-memory graphs
  (``torch.compiler.reset``): they hold the old generation's meshes, and with them its process
  groups (see ``workers/actor.py``). Other meshes' graphs are plain computation and stay.

Every step reports what it compiled and what it loaded (``CompileCounts``), so "a layout seen
before compiles nothing" is an event field, not a belief.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from checkpointing.torch_compat import inductor_graph_counts, settled
from elastic.spec import MeshSpec
from workers.models import StageModel
from workers.spec.messages import CompileCounts

log = logging.getLogger("meshpilot.compile")

# The environment inductor and Triton read their cache places and switches from.
_CACHE_ENVIRONMENT = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def use_job_caches(cache_dir: str, node_id: str) -> Path:
    """Point inductor and Triton at the job's cache directory on this node (``{node_id}`` in it is
    replaced, so tests can give each simulated node a disk of its own). Called by every rank actor
    before anything compiles; the variables are read when a graph is compiled."""
    path = Path(cache_dir.replace("{node_id}", node_id))
    path.mkdir(parents=True, exist_ok=True)
    os.environ.update(_CACHE_ENVIRONMENT)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    return path


def compile_blocks(module: StageModel) -> None:
    """Compile each transformer block's forward in place (parameter names unchanged, so
    checkpoints do not see it). After tensor parallelism and float8 (their hooks and layers are
    traced into the block's graph), before activation checkpointing (which recomputes the compiled
    forward: tracing torch's checkpoint of a tensor-parallel block fails on torch 2.13, a mesh among
    the saved values) and FSDP2 (whose hooks run around the block's call).

    What the stage's other modules (the embedding, the head) hand a block is settled first: a
    tensor-parallel embedding returns the lazily waited result of its reduce-scatter, through which
    a compiled block would pass back no gradient (``torch_compat.settled``).
    """
    for block in module.layers.values():
        block.forward = torch.compile(block.forward, fullgraph=True)
    for child in module.children():
        if child is not module.layers:
            child.register_forward_hook(_settle_output)


def _settle_output(_module: torch.nn.Module, _args: object, output: torch.Tensor) -> torch.Tensor:
    return settled(output)


class CompileWatch:
    """What this process's inductor compiled and loaded, per step (``since_last``)."""

    def __init__(self) -> None:
        self._seen = inductor_graph_counts()

    def since_last(self) -> CompileCounts:
        compiled, loaded = inductor_graph_counts()
        counts = CompileCounts(compiled=compiled - self._seen[0], cache_hits=loaded - self._seen[1])
        self._seen = (compiled, loaded)
        return counts


def forget_compiled_graphs(mesh: MeshSpec) -> None:
    """Leaving a generation of ``mesh``: drop dynamo's in-memory graphs if they hold its process
    groups (the caches on disk stay). Runs on every rank leaving a generation, after its trainer
    closed.

    A tensor- or context-parallel block's graph holds its groups and their meshes, and every
    reference to a group must go for its sockets to close (``workers/actor.py``). A block's graph
    on a data-parallel or pipeline mesh is plain computation (FSDP2's collectives run in its hooks,
    outside): it is kept, and the next generation's blocks run it at once when its guards hold
    (the same per-rank shapes), tracing nothing again.
    """
    if mesh.tp > 1 or mesh.cp > 1:
        torch.compiler.reset()


def _artifacts_key(mesh: MeshSpec, rank: int) -> str:
    return f"compile/{mesh.describe()}/{rank}"


def publish_artifacts(store: dist.Store, mesh: MeshSpec, rank: int) -> int:
    """After a step in which this rank compiled graphs: put its cache artifacts on the job's store
    for ranks that join this layout on a node whose cache lacks them. Returns the bytes published."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    artifacts, _ = saved
    store.set(_artifacts_key(mesh, rank), artifacts)  # type: ignore[arg-type]  # c10d stores take bytes too
    return len(artifacts)


def load_published_artifacts(store: dist.Store, mesh: MeshSpec) -> int:
    """Before building a trainer for ``mesh``: load into this node's cache every rank's artifacts
    published for the layout (a rank's stages and shards differ, and a joiner's rank number says
    nothing of which rank compiled what). Returns how many blobs were loaded."""
    started = time.perf_counter()
    loaded = 0
    for rank in range(mesh.world_size):
        key = _artifacts_key(mesh, rank)
        if not store.check([key]):
            continue
        torch.compiler.load_cache_artifacts(store.get(key))
        loaded += 1
    if loaded:
        log.info(
            "loaded %d ranks' compile artifacts for %s in %.2f s",
            loaded,
            mesh.describe(),
            time.perf_counter() - started,
        )
    return loaded
