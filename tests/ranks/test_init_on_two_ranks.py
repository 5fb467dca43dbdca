"""Initialisation is the same model whatever the mesh, and a rank draws only its own slice: the
debug model on two spawned gloo ranks (``tests/ranks/init_ranks.py``) under dp_shard=2 and under
tp=2, put back together and compared with one process's initialisation.

Slices of one parameter at any offsets, without a process group: tests/unit/test_init_slices.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from elastic.spec import MeshSpec
from tests.ranks.init_ranks import SPEC, run_rank
from tests.ranks.spawned_ranks import spawn_ranks
from tests.unit.test_init_slices import small_tiles  # noqa: F401 - the fixture, shared with the slice tests
from workers.initial_values import init_weights
from workers.models import resolve_family


def one_process_model() -> dict[str, torch.Tensor]:
    family = resolve_family(SPEC.model.family)
    with torch.device("meta"):
        module = family.build(SPEC.model)
    module.to_empty(device=torch.device("cpu"))
    init_weights(module, family, SPEC.model, seed=SPEC.seed)
    return {fqn: param.detach() for fqn, param in module.named_parameters()}


@pytest.mark.parametrize("mesh", [MeshSpec(dp_shard=2), MeshSpec(tp=2)], ids=["dp_shard2", "tp2"])
def test_two_ranks_initialise_the_one_process_model_each_drawing_only_its_slice(small_tiles, mesh, tmp_path):  # noqa: F811
    reference = one_process_model()
    ranks = spawn_ranks(functools.partial(run_rank, mesh), world_size=2, store_path=str(tmp_path / "store"))
    for rank, (slices, drawn) in ranks.items():
        random_values = 0
        for fqn, (offset, values) in slices.items():
            index = tuple(slice(start, start + length) for start, length in zip(offset, values.shape))
            assert torch.equal(torch.from_numpy(values), reference[fqn][index]), (rank, fqn)
            random_values += values.size if not fqn.endswith("norm.weight") else 0
        # The debug model's dims split on tile boundaries here: exactly its own slice, nothing more.
        assert drawn == random_values, rank
