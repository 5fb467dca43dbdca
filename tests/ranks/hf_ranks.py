"""Two ranks on real gloo load one Hugging Face directory into DTensors, for tests/ranks/test_hf_sharded_load.py.

The directory is ``<folder of store_path>/hf`` (written by the test before it spawns). Each rank
loads the row-sharded parameters, then the column-sharded ones, and sends back its local slices
(numpy: plain pickles) and the bytes each load read.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from checkpointing.hf_format import load_hf_tensors, open_hf_checkpoint
from checkpointing.local import LocalStorage

# our FQN -> (HF name, global shape); the files hold bfloat16 and float32, the parameters are float32.
# The embedding is 4 MiB, so that the half a rank skips is more than the reader's merge gap.
ROW_SHARDED = {"embed.weight": ("model.embed_tokens.weight", (4096, 512)), "norm.weight": ("model.norm.weight", (64,))}
COLUMN_SHARDED = {"wo.weight": ("model.layers.0.self_attn.o_proj.weight", (96, 64))}


def sharded(mesh, shape: tuple[int, ...], placement: Shard) -> DTensor:
    local = list(shape)
    local[placement.dim] //= mesh.size()
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        torch.zeros(local), mesh, [placement], run_check=False, shape=torch.Size(shape), stride=stride
    )


def run_rank(rank: int, store_path: str, results) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        storage = LocalStorage(Path(store_path).parent / "hf", fsync=False)
        checkpoint = open_hf_checkpoint(storage)
        outcome = {}
        for label, params, placement in (("rows", ROW_SHARDED, Shard(0)), ("columns", COLUMN_SHARDED, Shard(1))):
            tensors = {fqn: sharded(mesh, shape, placement) for fqn, (_, shape) in params.items()}
            read = load_hf_tensors(storage, checkpoint, dict(tensors), {fqn: hf for fqn, (hf, _) in params.items()})
            outcome[label] = (read, {fqn: value.to_local().numpy().copy() for fqn, value in tensors.items()})
        results.put((rank, outcome))
    except BaseException as error:  # noqa: BLE001 - the test reads it instead of waiting for a timeout
        results.put((rank, repr(error)))
    finally:
        dist.destroy_process_group()
