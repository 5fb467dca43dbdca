"""Evaluation while training in a real run (Ray, gloo, pp=2 x tp=2 x dp_shard=2): eval events at
the configured boundaries with a falling loss, a console line for each, the Prometheus gauge and
the TensorBoard scalars showing them; and one eval event per boundary across a rank's loss."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import orchestrator.driver.run as run_module
from orchestrator.observe.metrics import build_metrics
from tests.jobs import train

STEPS = 12


@pytest.mark.slow  # ~50 s on 2 cores; make test evaluates through the pp2-dualpipev-eval loss-parity layout
def test_a_run_evaluates_every_five_steps_and_shows_it(ray_cluster, tmp_path, monkeypatch, capsys):
    exporters = []
    monkeypatch.setattr(
        run_module, "build_metrics", lambda config: exporters.append(build_metrics(config)) or exporters[0]
    )
    result, events = train(
        tmp_path / "run",
        f"training.steps={STEPS}",
        "eval.interval_steps=5",
        "eval.batches=2",
        "eval.at_start=true",
        f"metrics.tensorboard_dir={tmp_path / 'tb'}",
    )
    assert result.exit_code == 0, result.reason
    evals = [e for e in events if e["event"] == "eval"]
    # Before step 1, every 5 steps, and after the last step.
    assert [e["step"] for e in evals] == [0, 5, 10, STEPS]
    assert all(e["tokens"] == 2 * 16 * 128 for e in evals)  # eval.batches x global_batch x seq_len
    losses = [e["loss"] for e in evals]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.5, losses
    shown = capsys.readouterr().err
    for e in evals:
        assert f"eval at step {e['step']}: loss {e['loss']:.4f}" in shown
    exposition = exporters[0].render().decode()
    assert f"meshpilot_eval_loss {losses[-1]}" in exposition
    reader = EventAccumulator(str(tmp_path / "tb"))
    reader.Reload()
    read = {scalar.step: scalar.value for scalar in reader.Scalars("eval/loss")}
    assert read == pytest.approx({e["step"]: e["loss"] for e in evals}, rel=1e-6)
    assert sorted(scalar.step for scalar in reader.Scalars("train/loss")) == list(range(1, STEPS + 1))
