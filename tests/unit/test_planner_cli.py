"""``meshpilot plan`` as a user runs it: the table, the JSON, and one clear line for every mistake.

Run: python -m pytest tests/unit/test_planner_cli.py -q
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.cli import main

REPO = Path(__file__).resolve().parents[2]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_405b_at_llama3_scale_prints_best_layouts_and_rejections(capsys):
    code, out, err = run(
        capsys,
        "plan",
        "--model",
        "llama3-405b",
        "--gpus",
        "16384",
        "--seq-len",
        "8192",
        "--global-batch",
        "2048",
        "--top",
        "3",
    )
    assert code == 0 and err == ""
    assert out.startswith("meshpilot plan: llama3-405b (405.9B parameters) on 16384 x h100-80g")
    table = [line for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s+\d+\s+\d+\s+\d+\s", line)]
    assert len(table) == 3
    degrees = [tuple(int(x) for x in line.split()[1:5]) for line in table]  # dp_rep, dp_shard, tp, pp
    assert any(tp == 8 and pp == 16 and dp_rep * dp_shard == 128 for dp_rep, dp_shard, tp, pp in degrees)
    assert "config: parallelism: {dp_replicate: 1, pp: 16, dp_shard: 128, tp: 8, pp_schedule: interleaved_1f1b" in out
    assert "  tp=16..128: tp=16 must divide model.n_kv_heads=8 (and likewise for the larger tp)" in out
    assert re.search(
        r"  tp=8 pp=4 dp=512: needs \d+\.\d GB per GPU with activation checkpointing > 72\.0 GB usable", out
    )


def test_plan_json_is_one_object_with_the_chosen_layouts(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama3-70b", "--gpus", "256", "--global-batch", "512", "--json")
    assert code == 0
    document = json.loads(out)
    assert document["gpus"] == 256 and document["seq_len"] == 8192 and document["global_batch"] == 512
    assert len(document["plans"]) == 5 and document["feasible"] >= 5
    first = document["plans"][0]
    assert first["rank"] == 1
    assert first["memory"]["total_gb"] <= first["memory"]["usable_gb"] == 72.0
    assert set(first["comm"]) == {"tp", "pp", "dp_shard", "dp_replicate"}
    assert (
        first["parallelism"]["tp"]
        * first["parallelism"]["pp"]
        * first["parallelism"]["dp_shard"]
        * first["parallelism"]["dp_replicate"]
        == 256
    )
    steps = [plan["step_s"] for plan in document["plans"]]
    assert steps == sorted(steps)
    assert all({"layout", "reason", "kind"} <= set(rejection) for rejection in document["rejected"])


def test_plan_reads_the_model_and_batch_from_a_job_config(capsys, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(
        "name: my-8b\nmodel: {preset: llama3-8b}\n"
        "parallelism: {dp_shard: 8, tp: 1, pp: 1, microbatches: 1, activation_checkpointing: true}\n"
        "training: {global_batch: 16, seq_len: 8192, steps: 10, warmup_steps: 1}\n"
    )
    code, out, _ = run(capsys, "plan", "--model", str(config), "--gpus", "8")
    assert code == 0
    assert f"meshpilot plan: my-8b ({config})" in out
    assert "workload: seq_len 8192, global batch 16 sequences" in out
    assert re.search(
        r"the config's layout \(dp_replicate=1 x pp=1 x dp_shard=8 x tp=1, none, 1 microbatches, "
        r"AC on\): fits [\d.]+ GB, step [\d.]+ s, MFU [\d.]+%",
        out,
    )


def test_custom_gpu_flags_override_the_kind(capsys):
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        "llama3-8b",
        "--gpus",
        "8",
        "--gpu",
        "h200",
        "--gpu-memory-gb",
        "40",
        "--gpu-tflops",
        "500",
        "--json",
    )
    gpu = json.loads(out)["gpu"]
    assert code == 0 and gpu == {
        "name": "h200 (custom)",
        "memory_gb": 40.0,
        "bf16_tflops": 500.0,
        "nvlink_gb_per_s": 450.0,
        "network_gbit_per_s": 400.0,
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--model", "llama9", "--gpus", "8"],
            "meshpilot: --model 'llama9' is neither a preset (debug, llama3-1b, llama3-8b, llama3-70b, llama3-405b, "
            "debug-moe) nor a YAML job config; pass a preset name or the path of a config file\n",
        ),
        (["--model", "llama3-8b", "--gpus", "0"], "meshpilot: --gpus=0 must be >= 1\n"),
        (
            ["--model", "llama3-8b", "--gpus", "12"],
            "meshpilot: --gpus=12 is not a multiple of --gpus-per-node=8; plan whole nodes, or set --gpus-per-node\n",
        ),
        (
            ["--model", "llama3-8b", "--gpus", "8", "--gpu-memory-gb", "-1"],
            "meshpilot: --gpu-memory-gb=-1.0 must be > 0\n",
        ),
        (
            ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "16384"],
            "meshpilot: --seq-len=16384 exceeds the model's max_seq_len=8192\n",
        ),
        (["--model", "llama3-8b", "--gpus", "8", "--tp", "0"], "meshpilot: --tp=0 must be >= 1\n"),
        (
            ["--model", "llama3-8b", "--gpus", "16", "--tp", "4", "--pp", "3"],
            "meshpilot: the fixed degrees (--tp=4, --pp=3) multiply to 12, which does not divide --gpus=16\n",
        ),
        (
            ["--model", "llama3-8b", "--gpus", "8", "--ep", "2"],
            "meshpilot: --ep=2 needs a mixture-of-experts model (model.n_experts is not set): set --ep=1, or train "
            "a moe model (model.preset=debug-moe)\n",
        ),
        (
            ["--model", "debug-moe", "--gpus", "8", "--ep", "3"],
            "meshpilot: --ep=3 must divide model.n_experts=8 so that every rank holds as many experts; choose an ep "
            "that divides it\n",
        ),
        (
            ["--model", "debug-moe", "--gpus", "8", "--expert-routing-nodes", "0"],
            "meshpilot: --expert-routing-nodes=0 must be >= 1\n",
        ),
        (
            ["--model", "missing.yaml", "--gpus", "8"],
            "meshpilot: invalid config: config file 'missing.yaml' does not exist; pass the path of a YAML job file\n",
        ),
    ],
)
def test_bad_flags_give_one_clear_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, "plan", *argv)
    assert code == 2
    assert err == message
    assert out == ""


def test_a_model_that_fits_nowhere_says_so_and_exits_2(capsys):
    code, out, err = run(capsys, "plan", "--model", "llama3-405b", "--gpus", "8", "--global-batch", "16")
    assert code == 2
    assert re.fullmatch(
        r"meshpilot: no layout of llama3-405b fits on 8 x h100-80g: the smallest "
        r"\(tp=8 pp=\d+ dp=\d+\) needs \d+\.\d GB per GPU > 72\.0 GB usable; "
        r"use more GPUs or GPUs with more memory\n",
        err,
    ), err
    assert "rejected (one line per family of layouts):" in out


def test_a_batch_no_mesh_can_split_says_so(capsys):
    code, _, err = run(capsys, "plan", "--model", "debug", "--gpus", "8", "--global-batch", "3", "--seq-len", "128")
    assert code == 2
    assert err == (
        "meshpilot: no layout of debug divides onto 8 x h100-80g (see the rejected families above); "
        "change --gpus, --global-batch or --seq-len\n"
    )


def test_the_installed_command_plans_16384_gpus_quickly():
    """A real process, as a user types it; the search itself reports its time."""
    started = time.perf_counter()
    process = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "plan", "--model", "llama3-405b", "--gpus", "16384", "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    wall = time.perf_counter() - started
    assert process.returncode == 0, process.stderr
    document = json.loads(process.stdout)
    assert document["elapsed_s"] < 1.0
    assert document["meshes_considered"] == 680  # ordered 4-factorisations of 2^14
    print(f"meshpilot plan for 16384 GPUs: {wall:.2f} s wall, search {document['elapsed_s']:.3f} s")


def test_an_unknown_gpu_kind_is_refused_by_the_parser():
    process = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "plan", "--model", "debug", "--gpus", "8", "--gpu", "a100"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert process.returncode == 2
    # Python versions differ in quoting the choices; the line is otherwise fixed.
    assert re.fullmatch(
        r"meshpilot plan: error: argument --gpu: invalid choice: 'a100' "
        r"\(choose from '?b200'?, '?h100-80g'?, '?h200'?, '?h800'?\)\n",
        process.stderr,
    ), process.stderr


def test_plan_with_a_fixed_cp_prices_the_key_value_gather(capsys):
    code, out, err = run(
        capsys, "plan", "--model", "llama3-405b", "--gpus", "16384", "--seq-len", "8192", "--cp", "2", "--top", "1"
    )
    assert code == 0 and err == ""
    assert re.search(r"^\s+1\s.* cp=2\s", out, re.MULTILINE)
    assert re.search(r"^\s+- cp [\d.]+ GB/step over (nvlink|network)", out, re.MULTILINE)
    assert re.search(r"config: parallelism: \{dp_replicate: \d+, pp: \d+, dp_shard: \d+, cp: 2, tp: \d+", out)


def test_plan_of_a_mixture_of_experts_prices_each_expert_parallel_degree(capsys):
    code, out, err = run(capsys, "plan", "--model", "debug-moe", "--gpus", "8", "--seq-len", "512", "--top", "20")
    assert code == 0 and err == ""
    assert re.search(r"^\s+\d+\s.* ep=2\s", out, re.MULTILINE) and re.search(r"^\s+\d+\s.* ep=8\s", out, re.MULTILINE)
    assert re.search(r"^\s+- ep [\d.]+ GB/step over nvlink", out, re.MULTILINE)
    assert re.search(r"config: parallelism: \{.*ep: 8, microbatches", out)
    code, out, _ = run(capsys, "plan", "--model", "debug-moe", "--gpus", "8", "--seq-len", "512", "--ep", "4", "--json")
    plans = json.loads(out)["plans"]
    assert code == 0 and plans and all(plan["parallelism"]["ep"] == 4 for plan in plans)
