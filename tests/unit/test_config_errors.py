"""Bad configs: one clear error naming key, value and reason; exit code 2; never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from orchestrator.cli import main
from orchestrator.config import load_config
from tests.jobs import DEMO_CONFIG, REPO

CASES = [
    (["--set", "parallelism.tpp=2"], "parallelism.tpp: unknown key; did you mean 'parallelism.tp'?"),
    (["--set", "training.lr=fast"], "training.lr: expected a number, got str 'fast'"),
    (["--set", "parallelism.tp=3"], "parallelism: tp=3 must divide model.n_heads=4"),
    (
        ["--set", "parallelism.pp=3", "--set", "parallelism.microbatches=3"],
        "parallelism: pp=3 x stages_per_rank=1 = 3 pipeline stages must divide model.n_layers=4",
    ),
    (
        ["--set", "parallelism.dp_shard=3"],
        "parallelism: dp_replicate=1 x dp_shard=3 x microbatches=4 = 12 must divide training.global_batch=16",
    ),
    (
        ["--set", "parallelism.pp_schedule=1f1"],
        "parallelism.pp_schedule: '1f1' is not one of gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv, dualpipev; "
        "did you mean '1f1b'?",
    ),
    (
        ["--set", "parallelism.pp_schedule=zero_bubble", "--set", "parallelism.microbatches=3"],
        "parallelism.microbatches=3 must be a multiple of pp=2 for pp_schedule=zero_bubble",
    ),
    (
        ["--set", "parallelism.pp_schedule=dualpipev", "--set", "parallelism.microbatches=2"],
        "parallelism.microbatches=2 must be >= the 4 pipeline stages (2 x pp=2) for pp_schedule=dualpipev",
    ),
    (
        ["--set", "parallelism.pp_schedule=zbv", "--set", "parallelism.stages_per_rank=3"],
        "parallelism.stages_per_rank=3: pp_schedule=zbv places exactly 2 stages per rank "
        "(stage r and 2 pp - 1 - r on rank r); leave it unset",
    ),
    (
        ["--set", "parallelism.pp_schedule=zero_bubble", "--set", "parallelism.stages_per_rank=1"],
        "parallelism.stages_per_rank must be >= 2 for pp_schedule=zero_bubble",
    ),
    (
        ["--set", "parallelism.stages_per_rank=2"],
        "parallelism.stages_per_rank=2 needs pp_schedule=interleaved_1f1b or zero_bubble "
        "(zbv and dualpipev hold exactly 2)",
    ),
    (
        ["--set", "parallelism.pp_schedule=zbv", "--set", "parallelism.pp=4", "--set", "parallelism.tp=1"],
        "parallelism: pp=4 x stages_per_rank=2 = 8 pipeline stages must divide model.n_layers=4",
    ),
    (
        ["--set", "parallelism.reshard_after_forward=sometimes"],
        "parallelism.reshard_after_forward: 'sometimes' is not one of auto, always, never",
    ),
    (["--set", "parallelism.cpu_offload=maybe"], "parallelism.cpu_offload: expected true or false, got str 'maybe'"),
    (["--set", "training.steps=0"], "training.steps=0 must be >= 1"),
    (["--set", "data.path=no/such/file.txt"], "data.path='no/such/file.txt': no such file"),
    (
        ["--set", "checkpoint.uri=gs://bucket/run"],
        "checkpoint.uri='gs://bucket/run': scheme 'gs' is not supported; use s3://, file:// or a directory",
    ),
    (["--set", "runtime.backend=nccl"], "runtime.backend=nccl needs runtime.gpus_per_rank > 0"),
    (
        ["--set", "runtime.gpus_per_rank=0.5"],
        "runtime.gpus_per_rank=0.5 must be 0 (CPU ranks, gloo) or 1 (one GPU per rank, NCCL): "
        "NCCL refuses two ranks on one GPU",
    ),
    (
        ["--set", "runtime.gpus_per_rank=2"],
        "runtime.gpus_per_rank=2 must be 0 (CPU ranks, gloo) or 1 (one GPU per rank, NCCL)",
    ),
    (["--set", "runtime.gpus_per_rank=-1"], "runtime.gpus_per_rank=-1 must be 0 (CPU ranks, gloo) or 1"),
    (
        ["--set", "parallelism.microbatches=1"],
        "parallelism.microbatches=1 must be >= pp=2 so that every pipeline stage has work",
    ),
    (["--set", "training.seq_len=4096"], "training.seq_len=4096 exceeds the model's max_seq_len=2048"),
    (["--set", "model.preset=llama9"], "model.preset: 'llama9' is not one of debug, llama3-1b"),
    (
        ["--set", "parallelism.activation_checkpointing=maybe"],
        "parallelism.activation_checkpointing: expected true or false, got str 'maybe'",
    ),
    (["--set", "nonsense"], "--set 'nonsense': expected dotted.key=value"),
    (["--set", "elastic.min_replicas=2"], "elastic.min_replicas=2 exceeds parallelism.dp_replicate=1"),
    (["--set", "eval.interval_steps=-5"], "eval.interval_steps=-5 must be >= 0"),
    (["--set", "eval.batches=0"], "eval.batches=0 must be >= 1"),
    (["--set", "eval.interval_steps=often"], "eval.interval_steps: expected an integer, got str 'often'"),
    (["--set", "eval.batch=2"], "eval.batch: unknown key; did you mean 'eval.batches'?"),
    (
        ["--set", "eval.at_start=true"],
        "eval.at_start=true does nothing while eval.interval_steps=0 (evaluation off): "
        "set eval.interval_steps to a number of steps, or eval.at_start=false",
    ),
    (["--chaos", "seven"], "--chaos 'seven': expected SEED[:N] with integers, e.g. --chaos 7:6"),
    (["--chaos", "7:0"], "--chaos '7:0': SEED must be >= 0 and N >= 1"),
    (["--chaos", "7:60"], "--chaos: 60 faults need at least 63 steps (training.steps=50)"),
    (["--set", "elastic.snapshot_interval_steps=-1"], "elastic.snapshot_interval_steps=-1 must be >= 0"),
    (["--set", "elastic.snapshot_memory_limit_mb=0"], "elastic.snapshot_memory_limit_mb=0 must be >= 1"),
    (
        ["--set", "elastic.snapshot_overhead_limit=1.5"],
        "elastic.snapshot_overhead_limit=1.5 must lie in [0, 1): the fraction of step time snapshots may cost "
        "(0: no limit)",
    ),
    (
        ["--set", "elastic.snapshot_memory_limit_mb=1"],
        "elastic.snapshot_memory_limit_mb=1 is too small for peer-memory snapshots: each rank holds about 1.3 MiB "
        "(2 snapshots of its 0.3 MiB share of parameters and optimizer state, and as many of its buddy's); raise "
        "the limit, shard the state over more ranks (dp_shard, tp, pp), or set elastic.snapshot_interval_steps=0",
    ),
    (
        ["--inject", "hang@5:1/configure"],
        "the phases are /configure (for kill and raise, e.g. kill@5:1/configure), /join (for kill: as a configured",
    ),
    (
        ["--set", "model.preset=debug-moe", "--set", "parallelism.tp=1", "--set", "model.top_k_experts=9"],
        "model.top_k_experts=9 must lie in 1..model.n_experts=8",
    ),
    (
        ["--set", "model.preset=debug-moe", "--set", "parallelism.tp=1", "--set", "model.router_bias_update_rate=-0.1"],
        "model.router_bias_update_rate=-0.1 must be >= 0 (0: no bias)",
    ),
    # A family's args hold its own fields: the llama family has no experts to set.
    (
        ["--set", "model.n_experts=8"],
        "model.n_experts is not a shape key of model family llama: leave it unset, or name a model.family "
        "(or model.preset) whose model has it",
    ),
    (
        ["--set", "model.family=moe", "--set", "parallelism.tp=1"],
        "model.n_experts must be >= 1 for model.family=moe (or use model.family=llama)",
    ),
    (["--set", "parallelism.cp=0"], "parallelism.cp=0 must be >= 1"),
    (
        ["--set", "parallelism.cp=3"],
        "parallelism: 2 x cp=3 = 6 must divide training.seq_len=128 "
        "(each cp rank keeps two of 2 x cp equal chunks of every sequence)",
    ),
    (
        ["--set", "parallelism.cp=4", "--set", "training.seq_len=20"],
        "parallelism: 2 x cp=4 = 8 must divide training.seq_len=20",
    ),
    (
        ["--set", "parallelism.cp=2", "--set", "parallelism.tp=4", "--set", "model.n_kv_heads=4"]
        + ["--set", "training.seq_len=12"],
        "parallelism: tp=4 must divide training.seq_len=12 / cp=2 = 6 (sequence parallel)",
    ),
    (
        ["--set", "parallelism.cp=4", "--set", "parallelism.cp_method=ulysses"],
        "parallelism.cp_method=ulysses splits attention heads over cp: model.n_heads=4 / tp=2 = 2 query heads "
        "do not split over cp=4; choose another parallelism.cp, or parallelism.cp_method ring or allgather",
    ),
    (
        ["--set", "parallelism.cp=6", "--set", "parallelism.cp_method=ulysses", "--set", "parallelism.tp=1"]
        + ["--set", "model.dim=96", "--set", "model.n_heads=12", "--set", "model.n_kv_heads=4"]
        + ["--set", "training.seq_len=120"],
        "parallelism.cp_method=ulysses splits attention heads over cp: model.n_kv_heads=4 / tp=1 = 4 key/value "
        "heads neither split over cp=6 nor divide it",
    ),
    (
        ["--set", "parallelism.cp=4", "--set", "parallelism.cp_method=ring", "--set", "training.seq_len=20"],
        "parallelism: 2 x cp=4 = 8 must divide training.seq_len=20",
    ),
    (
        ["--set", "parallelism.ep=2"],
        "parallelism.ep=2 needs a mixture-of-experts model (model.n_experts is not set): set parallelism.ep=1, "
        "or train a moe model (model.preset=debug-moe)",
    ),
    (
        ["--set", "model.preset=debug-moe", "--set", "parallelism.tp=1", "--set", "parallelism.ep=4"],
        "parallelism.ep=4 must divide parallelism.dp_shard=2: the experts are split over ranks of dp_shard; "
        "choose an ep that divides it",
    ),
    (
        [
            "--set",
            "model.preset=debug-moe",
            "--set",
            "parallelism.tp=1",
            "--set",
            "parallelism.dp_shard=6",
            "--set",
            "parallelism.ep=3",
            "--set",
            "training.global_batch=24",
        ],
        "parallelism.ep=3 must divide model.n_experts=8 so that every rank holds as many experts; "
        "choose an ep that divides it",
    ),
    (["--set", "parallelism.ep=0"], "parallelism.ep=0 must be >= 1"),
    (
        ["--set", "training.float8=true"],
        "training.float8=true needs CUDA GPUs of compute capability 8.9 or higher (Ada, Hopper or newer); this job's "
        "ranks run on the CPU (runtime.gpus_per_rank=0, gloo): set training.float8=false",
    ),
    (
        ["--set", "training.float8=true", "--set", "runtime.gpus_per_rank=1"],
        "training.float8=true cannot run with parallelism.tp=2",
    ),
    (["--set", "elastic.compile_timeout_s=0"], "elastic.compile_timeout_s=0.0 must be > 0"),
    (
        ["--set", "training.compile=true", "--set", "model.preset=debug-moe"],
        "training.compile=true cannot run with model.family=moe (a mixture of experts) yet (compiled blocks train "
        "dense models with FSDP2, tp, pp, cp and activation checkpointing): set training.compile=false",
    ),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[c[1][:40] for c in CASES])
def test_bad_value_gets_one_clear_error(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code = main(["train", str(DEMO_CONFIG), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("value", ["0.5", "2"])
def test_gpus_per_rank_other_than_0_or_1_is_one_error_with_the_fix(value, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code = main(["train", str(DEMO_CONFIG), "--set", f"runtime.gpus_per_rank={value}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.count("runtime.gpus_per_rank") == 2  # the key in the problem, and again in its fix
    assert f"runtime.gpus_per_rank={value} must be 0" in err and "set runtime.gpus_per_rank=1" in err


def test_missing_config_file(capsys):
    assert main(["train", "does-not-exist.yaml"]) == 2
    assert "config file 'does-not-exist.yaml' does not exist" in capsys.readouterr().err


def test_invalid_yaml_names_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: debug\nparallelism: {tp: 2\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad} is not valid YAML at line" in err


def test_top_level_must_be_a_mapping(tmp_path, capsys):
    bad = tmp_path / "list.yaml"
    bad.write_text("- model\n- parallelism\n")
    assert main(["train", str(bad)]) == 2
    assert "must hold a mapping of sections" in capsys.readouterr().err


def test_all_problems_listed_at_once(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(Exception) as caught:
        load_config(DEMO_CONFIG, ["training.lr=x", "parallelism.tpp=1"])
    assert len(caught.value.problems) == 2


def test_unknown_flag_exits_2_without_traceback():
    process = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "train", "--no-such-flag"], capture_output=True, text=True, cwd=REPO
    )
    assert process.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in process.stderr
    assert "Traceback" not in process.stderr


def test_resolved_config_round_trips(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    config = load_config(DEMO_CONFIG, ["parallelism.tp=1", "checkpoint.async=false"])
    saved = tmp_path / "config.yaml"
    saved.write_text(config.to_yaml())
    again = load_config(saved)
    assert again.to_dict() == config.to_dict()
    assert again.checkpoint.async_ is False
    assert again.config_hash() == config.config_hash()


def test_hash_ignores_layout_but_not_model(monkeypatch):
    monkeypatch.chdir(REPO)
    base = load_config(DEMO_CONFIG)
    assert load_config(DEMO_CONFIG, ["parallelism.tp=1"]).config_hash() == base.config_hash()
    assert load_config(DEMO_CONFIG, ["model.dim=128"]).config_hash() != base.config_hash()


def test_a_number_written_without_a_dot_in_its_mantissa_is_a_number():
    # YAML 1.1 (PyYAML) reads 1e-3 as a string; every other reader of YAML 1.2 or JSON as 0.001.
    config = load_config(DEMO_CONFIG, [f"data.path={REPO / 'data' / 'sample.txt'}", "training.lr=1e-3"])
    assert config.training.lr == 0.001
    config = load_config(DEMO_CONFIG, [f"data.path={REPO / 'data' / 'sample.txt'}", "training.lr=3E+0"])
    assert config.training.lr == 3.0
