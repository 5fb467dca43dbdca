"""RUN_DIR/samples.jsonl from the ranks' step reports (driver side, no Ray, no torch)."""

from __future__ import annotations

from elastic.spec import MeshSpec
from orchestrator.driver.rank_reports import ReportRouter
from orchestrator.driver.sample_ledger import SampleLedger, read_ledger
from orchestrator.observe.events import EventLog
from workers.spec.messages import StepReport

GLOBAL_BATCH = 8


def report(rank: int, step: int, mesh: MeshSpec) -> StepReport:
    dp_rank = mesh.dp_rank(rank)
    per_rank = GLOBAL_BATCH // mesh.dp
    first = (step - 1) * GLOBAL_BATCH + dp_rank * per_rank
    return StepReport(
        rank=rank,
        time=float(step),
        step=step,
        loss=1.0,
        dp_rank=dp_rank,
        step_time_s=0.1,
        sample_indices=tuple(range(first, first + per_rank)),
    )


def router_with_ledger(tmp_path, mesh: MeshSpec) -> ReportRouter:
    router = ReportRouter(EventLog(None), mesh=mesh, tokens_per_step=1)
    router.ledger = SampleLedger(tmp_path / "samples.jsonl", global_batch=GLOBAL_BATCH)
    return router


def test_one_line_per_applied_step_and_data_parallel_rank(tmp_path):
    mesh = MeshSpec(dp_shard=2, tp=2)  # two ranks per data-parallel slice report the same samples
    router = router_with_ledger(tmp_path, mesh)
    router.route([report(rank, 1, mesh) for rank in range(4)])
    router.route([report(rank, 2, mesh) for rank in range(3)])  # step 2 not applied by every rank yet
    lines = read_ledger(tmp_path / "samples.jsonl")
    assert [(line["step"], line["dp_rank"], line["indices"]) for line in lines] == [
        (1, 0, [0, 1, 2, 3]),
        (1, 1, [4, 5, 6, 7]),
    ]
    assert lines[0]["mesh"] == mesh.as_dict() and "reported" not in lines[0]


def test_a_slice_that_died_before_reporting_is_written_from_the_step_arithmetic(tmp_path):
    mesh = MeshSpec(dp_replicate=2, dp_shard=2)
    router = router_with_ledger(tmp_path, mesh)
    router.route([report(rank, 1, mesh) for rank in (0, 1, 2)])  # rank 3 applied step 1 and died
    router.flush(1)
    lines = read_ledger(tmp_path / "samples.jsonl")
    assert [line["indices"] for line in lines] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [line.get("reported", True) for line in lines] == [True, True, True, False]


def test_a_restore_removes_the_steps_it_takes_back(tmp_path):
    mesh = MeshSpec(dp_shard=2)
    router = router_with_ledger(tmp_path, mesh)
    for step in (1, 2, 3):
        router.route([report(rank, step, mesh) for rank in range(2)])
    router.rewind(1)  # restored from the checkpoint of step 1: steps 2 and 3 run again
    router.route([report(rank, 2, mesh) for rank in range(2)])
    assert [line["step"] for line in read_ledger(tmp_path / "samples.jsonl")] == [1, 1, 2, 2]
