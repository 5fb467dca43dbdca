"""The planner prices the three context-parallel methods per layout and picks one; ``meshpilot
plan --cp-method`` shows the comparison; ``parallelism.cp_method: auto`` resolves to a method.

Pure arithmetic (no ranks): tests/unit/test_planner.py covers the search around it.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from elastic.cost_model import Cluster, Layout, Workload, estimate
from elastic.hardware import gpu_spec
from elastic.planner import Constraints, cp_methods, pick_cp_method, plan_layouts
from elastic.spec import CpMethod, MeshSpec, cp_method_on_mesh
from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.driver.train_spec import train_spec
from tests.jobs import DEMO_CONFIG
from workers.spec import PRESETS

# Llama 3 8B at 8K tokens split over cp=8 inside one node: 32 query and 8 key/value heads.
WORKLOAD = Workload(PRESETS["llama3-8b"], seq_len=8192, global_batch=64)
CLUSTER = Cluster(64, 8, gpu_spec())
LAYOUT = Layout(MeshSpec(dp_replicate=8, dp_shard=1, cp=8), microbatches=1)


def priced(method: CpMethod, layout: Layout = LAYOUT):
    return estimate(WORKLOAD, CLUSTER, dataclasses.replace(layout, cp_method=method))


def test_ring_keeps_no_other_ranks_keys_and_hides_its_transfers():
    allgather, ring = priced(CpMethod.ALLGATHER), priced(CpMethod.RING)
    # Each layer keeps the gathered 7/8 of the sequence's keys and values for the backward (the
    # running layer holds them once more): 7 x 4096 bytes (2 x 8 heads x 128 x 2 bytes) for each of
    # the rank's 8192 tokens (8 sequences / 8 cp ranks), and its causal mask of 1024 x 8192
    # positions; ring holds one block in flight instead.
    kv_block, mask = 4096 * 8192, 2 * 1024 * 8192
    assert allgather.memory.activations - ring.memory.activations == pytest.approx(
        (32 + 1) * (7 * kv_block + mask) - kv_block
    )
    assert allgather.comm["cp"].exposed_s == allgather.comm["cp"].busy_s > 0
    assert ring.comm["cp"].busy_s > allgather.comm["cp"].busy_s  # dK/dV travel too...
    assert ring.comm["cp"].exposed_s == 0.0  # ...behind the attention of the block held
    assert ring.step_s < allgather.step_s


def test_ulysses_moves_queries_keys_values_and_outputs_once_each_way():
    allgather, ulysses = priced(CpMethod.ALLGATHER), priced(CpMethod.ULYSSES)
    # Ulysses: 7/8 of (2 x 32 query/output heads + 16 key/value heads); allgather: 7 x 16.
    assert ulysses.comm["cp"].bytes_per_step / allgather.comm["cp"].bytes_per_step == pytest.approx(
        (7 / 8 * (64 + 16)) / (7 * 16)
    )
    assert ulysses.comm["cp"].exposed_s == ulysses.comm["cp"].busy_s


def test_ulysses_is_priced_only_where_the_heads_split_over_cp():
    debug = PRESETS["debug"]  # 4 query heads, 2 key/value heads
    assert CpMethod.ULYSSES in cp_methods(debug, MeshSpec(dp_shard=1, cp=4))  # 2 kv heads, repeated
    assert CpMethod.ULYSSES not in cp_methods(debug, MeshSpec(dp_shard=1, cp=4, tp=2))  # 2 query heads
    assert cp_methods(debug, MeshSpec(dp_shard=1)) == [CpMethod.ALLGATHER]
    # A mesh chosen later (a restore) that Ulysses cannot run falls back to the all-gather.
    assert cp_method_on_mesh(CpMethod.ULYSSES, n_heads=4, n_kv_heads=2, tp=2, cp=4) is CpMethod.ALLGATHER
    assert cp_method_on_mesh(CpMethod.ULYSSES, n_heads=4, n_kv_heads=2, tp=1, cp=4) is CpMethod.ULYSSES


def test_the_planner_picks_a_method_per_layout():
    assert pick_cp_method(WORKLOAD, CLUSTER, LAYOUT) is CpMethod.RING
    assert pick_cp_method(WORKLOAD, CLUSTER, Layout(MeshSpec(dp_shard=64), microbatches=1)) is CpMethod.ALLGATHER
    result = plan_layouts(
        WORKLOAD, CLUSTER, constraints=Constraints(fixed={"cp": 8, "tp": 1, "pp": 1}, activation_checkpointing=(False,))
    )
    assert {plan.layout.cp_method for plan in result.plans} <= set(CpMethod)
    assert result.plans[0].layout.cp_method is CpMethod.RING
    only = Constraints(fixed={"cp": 8, "tp": 1, "pp": 1}, cp_methods=(CpMethod.ULYSSES,))
    assert {plan.layout.cp_method for plan in plan_layouts(WORKLOAD, CLUSTER, constraints=only).plans} == {
        CpMethod.ULYSSES
    }


def test_plan_cp_method_shows_the_comparison(capsys):
    argv = ["plan", "--model", "llama3-8b", "--gpus", "64", "--seq-len", "8192", "--global-batch", "64"]
    assert main([*argv, "--cp", "8", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "context parallel methods for layout 1 with cp > 1" in out
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^  (allgather|ring|ulysses)\s+([\d.]+)", out, re.M)}
    assert set(rows) == {"allgather", "ring", "ulysses"} and rows["ring"] < rows["allgather"]
    assert main([*argv, "--cp", "8", "--top", "1", "--cp-method", "ulysses"]) == 0
    assert "cp_method: ulysses" in capsys.readouterr().out


def test_cp_method_auto_is_allgather_on_cpu_and_the_planners_pick_on_gpus():
    on_cpu = load_config(DEMO_CONFIG, ["parallelism.cp=2", "parallelism.tp=1", "parallelism.pp=1"])
    assert on_cpu.parallelism.cp_method == "auto"
    assert train_spec(on_cpu).cp_method is CpMethod.ALLGATHER
    assert train_spec(load_config(DEMO_CONFIG, ["parallelism.cp=2", "parallelism.cp_method=ring"])).cp_method is (
        CpMethod.RING
    )
    on_gpus = train_spec(on_cpu, backend="nccl").cp_method
    assert on_gpus in set(CpMethod)
