"""``meshpilot report``: the summary's figures, the picture, and the errors for a bad run directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

import orchestrator.cli as cli
from orchestrator.analysis.timeline import format_summary, load_events, summarize
from orchestrator.analysis.timeline_plot import (
    MARKERS,
    PARTIAL_LOSS_COLOUR,
    STARTUP_ALPHA,
    STARTUP_COLOUR,
    _marker_text,
    render_timeline,
)
from tests.fixtures.synthetic_events import START_TIME, synthetic_run, write_events


@pytest.fixture
def report_main(monkeypatch):
    """``meshpilot`` with only the report command registered (other commands land separately)."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("orchestrator.cli.report",))
    return cli.main


def colour_share(image: np.ndarray, hex_colour: str, tolerance: float = 6 / 255, *, alpha: float = 1.0) -> float:
    """Share of the pixels that show ``hex_colour`` (drawn with ``alpha`` over white)."""
    rgb = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]) * alpha + (1 - alpha)
    return float((np.abs(image[..., :3] - rgb).max(axis=-1) <= tolerance).mean())


def has_colour(image: np.ndarray, hex_colour: str, tolerance: float = 6 / 255) -> bool:
    return colour_share(image, hex_colour, tolerance) > 0


def test_summary_of_a_run_with_failures_and_checkpoints():
    events = synthetic_run()
    summary = summarize(events)
    restored_at = next(i for i, e in enumerate(events) if e["event"] == "restored")
    effective = sum(
        e["step_time_s"]
        for i, e in enumerate(events)
        if e["event"] == "step" and not (i < restored_at and e["step"] > 50)
    )
    assert summary.effective_s == pytest.approx(effective)
    assert summary.wall_s == pytest.approx(events[-1]["time"] - START_TIME)
    assert summary.recovery_s == (3.0, 8.5)
    assert summary.lost_steps == 2
    assert summary.failures == ("actor_died", "node_died")
    assert summary.stall_s == pytest.approx(sum(e["stall_s"] for e in events if e["event"] == "checkpoint_staged"))
    assert (summary.checkpoints_committed, summary.checkpoint_failures) == (5, 1)
    assert summary.world_sizes == (8, 4, 8, 4)
    text = format_summary(summary)
    assert f"effective training time: {effective:.1f} s ({effective / summary.wall_s:.1%} of wall time)" in text
    assert "recovery times: 3.0 s, 8.5 s; lost steps: 2; restores from checkpoint: 1" in text
    assert "failures: 2 (actor_died x1, node_died x1)" in text
    assert f"total stall {summary.stall_s:.2f} s" in text
    assert "checkpoints: 5 committed (240.0 MB), 1 failed;" in text
    assert "drains: 1 (paused 0.3 s); grows: 1 (paused 1.5 s)" in text  # pauses, not recoveries


def test_report_command_draws_the_timeline_and_prints_the_summary(tmp_path, report_main, capsys):
    run_dir = tmp_path / "run"
    write_events(run_dir, synthetic_run())
    assert report_main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "run synthetic: finished, step 60/60" in out
    assert "lost steps: 2" in out
    assert f"timeline: {run_dir / 'timeline.png'}" in out
    image = imread(run_dir / "timeline.png")
    assert image.shape[:2] == (1100, 1430)
    for kind, (colour, _, _) in MARKERS.items():  # every kind of marker is drawn (the legend at least)
        assert has_colour(image, colour), f"no {kind} marker in the picture"


def test_a_quiet_run_has_no_failure_markers(tmp_path):
    events = [e for e in synthetic_run() if e["event"] in ("start", "step", "done")][:21] + [
        {"event": "done", "time": START_TIME + 20.0, "status": "finished", "steps": 20, "elapsed_s": 20.0}
    ]
    image = imread(render_timeline(events, tmp_path / "quiet.png"))
    assert not has_colour(image, MARKERS["failure"][0])
    assert not has_colour(image, MARKERS["recovered"][0])
    assert has_colour(image, "#17becf")  # the throughput line


def test_a_killed_run_still_renders(tmp_path, report_main, capsys):
    events = synthetic_run()[:40]
    path = write_events(tmp_path, events)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write('{"event": "step", "ti')  # torn last line of a killed driver
    assert report_main(["report", str(tmp_path), "--out", str(tmp_path / "out" / "t.png")]) == 0
    assert "running or killed (no done event)" in capsys.readouterr().out
    assert (tmp_path / "out" / "t.png").stat().st_size > 10_000


def test_a_run_without_steps_renders(tmp_path):
    start = synthetic_run()[0]
    out = render_timeline([start], tmp_path / "nothing.png")
    assert out.stat().st_size > 10_000
    assert summarize([start]).last_step == 0


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "run directory '{d}' does not exist; pass the directory `meshpilot train` printed at start"),
        (lambda d: d.mkdir(), "'{d}' has no events.jsonl, so it is not a meshpilot run directory"),
        (lambda d: (d.mkdir(), (d / "events.jsonl").write_text("")), "'{d}/events.jsonl' holds no events"),
        (lambda d: (d.mkdir(), (d / "events.jsonl").write_text("not json\n")), "'{d}/events.jsonl' holds no events"),
    ],
)
def test_bad_run_directory_is_one_clear_error(tmp_path, report_main, capsys, setup, message):
    run_dir = tmp_path / "run"
    setup(run_dir)
    assert report_main(["report", str(run_dir)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("meshpilot: " + message.format(d=run_dir))
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.out == ""


def test_load_events_keeps_order_and_fields(tmp_path):
    events = synthetic_run()
    write_events(tmp_path, events)
    assert load_events(tmp_path) == json.loads(json.dumps(events))


RECORDED_RUN = Path(__file__).resolve().parents[1] / "data" / "run-kill-rank3"


def test_report_of_a_recorded_real_run_with_a_killed_rank(tmp_path, report_main, capsys):
    """events.jsonl of a real run, recorded with

        meshpilot train configs/tiny-3d.yaml --set parallelism.dp_replicate=2 --set parallelism.dp_shard=2 \\
          --set parallelism.tp=1 --set parallelism.pp=1 --set training.steps=20 \\
          --set checkpoint.uri=/tmp/obs2/ckpt1 --set checkpoint.interval_steps=4 --inject kill@8:3

    Rank 3 died after applying step 7 but before reporting it; its replica group left and the
    other one went on alone (4 -> 2 ranks) with no step lost; checkpoints every 4 steps.
    """
    out = tmp_path / "timeline.png"
    assert report_main(["report", str(RECORDED_RUN), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines() == [
        "run tiny-3d: finished, step 20/20, wall time 21.0 s (start-up 9.4 s)",
        "effective training time: 10.7 s (50.8% of wall time)",
        "failures: 1 (rank_died x1)",
        "recovery times: 0.7 s; lost steps: 0; restores from checkpoint: 0",
        "checkpoints: 5 committed (13.9 MB), 0 failed; total stall 0.06 s",
        "world size: 4 -> 2; drains: 0; grows: 0",
        "loss from the ranks that reported only (a rank left before its report): step 7",
        f"timeline: {out}",
    ]
    events = load_events(RECORDED_RUN)
    summary = summarize(events)
    steps = [e for e in events if e["event"] == "step"]
    assert summary.effective_s == pytest.approx(sum(e["step_time_s"] for e in steps))
    assert summary.checkpoint_bytes == 5 * 2_789_620
    assert summary.partial_loss_steps == (7,)
    image = imread(out)
    for colour in (MARKERS["failure"][0], MARKERS["recovered"][0], PARTIAL_LOSS_COLOUR):
        assert has_colour(image, colour), colour
    # 9.4 s of 21 s grey across every panel: start-up, not a gap in the data
    assert colour_share(image, STARTUP_COLOUR, alpha=STARTUP_ALPHA) > 0.2
    for kind in ("drain", "grow", "restored"):  # nothing of the kind happened
        assert not has_colour(image, MARKERS[kind][0]), kind


def test_a_save_dropped_by_a_mesh_change_is_told_apart(tmp_path):
    events = synthetic_run()
    failure_at = next(i for i, e in enumerate(events) if e["event"] == "failure")
    events.insert(
        failure_at + 1,
        {
            "event": "checkpoint_failed",
            "time": events[failure_at]["time"],
            "step": 20,
            "error": "the mesh changed before every rank reported",
        },
    )
    summary = summarize(events)
    assert (summary.checkpoint_failures, summary.checkpoints_interrupted) == (2, 1)
    assert "5 committed (240.0 MB), 2 failed (1 interrupted by a mesh change);" in format_summary(summary)
    assert render_timeline(events, tmp_path / "t.png").stat().st_size > 10_000


def test_report_of_a_recorded_real_drain_and_grow(tmp_path, report_main, capsys):
    """events.jsonl of tests/faults/test_nodes.py's Ray drain (``drain@5:2``): each replica group on
    its own Ray node; rank 2's node is drained, its replica group leaves at a step boundary, and
    a replacement replica group joins later (4 -> 2 -> 4 ranks). No failure, nothing lost.
    """
    run_dir = Path(__file__).resolve().parents[1] / "data" / "run-drain-grow"
    out = tmp_path / "timeline.png"
    assert report_main(["report", str(run_dir), "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "run tiny-3d: finished, step 24/24, wall time 58.5 s (start-up 23.0 s)",
        "effective training time: 33.0 s (56.3% of wall time)",
        "failures: 0",
        "recovery times: none; lost steps: 0; restores from checkpoint: 0",  # a drain is no failure
        "checkpoints: none",
        "world size: 4 -> 2 -> 4; drains: 1 (paused 5.1 s); grows: 1 (paused 3.4 s)",
        "loss from the ranks that reported only (a rank left before its report): step 5",
        f"timeline: {out}",
    ]
    image = imread(out)
    for kind in ("drain", "grow"):
        assert has_colour(image, MARKERS[kind][0]), kind
    for kind in ("failure", "recovered", "restored"):  # no failure, so no recovery drawn either
        assert not has_colour(image, MARKERS[kind][0]), kind
    drain = next(e for e in load_events(run_dir) if e["event"] == "drain")
    assert _marker_text(drain) == f"drain: node {drain['node'][:8]}, ranks 2, 3"  # not 56 hex digits
