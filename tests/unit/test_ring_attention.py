"""Ring attention (``parallelism.cp_method: ring``) equals attention over the whole sequence: its
output and the gradients of queries, keys and values, on cp=2 and cp=4 rings, with grouped heads
and with packed documents (a boundary inside a chunk, a document across ranks), on torch's fused
CPU kernel and on the math path (what CUDA runs); bfloat16 inputs give bfloat16 results near them.

Spawned gloo ranks (``tests/ranks/ring_ranks.py``), one spawn for every case: starting ranks
costs more than the cases.
"""

from __future__ import annotations

import functools

import pytest

from tests.ranks import ring_ranks
from tests.ranks.spawned_ranks import spawn_ranks


def test_ring_attention_equals_whole_sequence_attention(tmp_path):
    reports = spawn_ranks(ring_ranks.run_rank, world_size=ring_ranks.WORLD_SIZE, store_path=str(tmp_path / "store"))
    assert sorted(reports) == list(range(ring_ranks.WORLD_SIZE))
    for rank, (report,) in reports.items():
        assert len(report) == 20
        for case, errors in report.items():
            # bfloat16: its own output and gradients, within 2% of the largest float32 value.
            assert max(errors.values()) < (2e-2 if "bfloat16" in case else 1e-5), (rank, case, errors)


# Traced by dynamo and AOTAutograd (aot_eager): the inductor backend, which also checks the custom
# operators' fake strides, takes some 45 s on 2 cores (run by hand: backend="inductor").
@pytest.mark.slow
def test_ring_attention_inside_a_compiled_block_equals_eager(tmp_path):
    run_rank = functools.partial(ring_ranks.run_compiled_rank, backend="aot_eager")
    reports = spawn_ranks(run_rank, world_size=2, store_path=str(tmp_path / "store"))
    for rank, (outcome,) in reports.items():
        assert isinstance(outcome, float) and outcome < 1e-6, (rank, outcome)
    assert sorted(reports) == [0, 1]
