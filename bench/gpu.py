"""GPU throughput: tokens/s and MFU of meshpilot against torchrun, same model, mesh and GPUs.

    python bench/gpu.py --quick      # 12 steps per run
    python bench/gpu.py              # 40 steps per run

For the ``debug`` and ``llama3-1b`` presets, on every GPU of this machine (FSDP over
dp_shard = the GPU count, one rank per GPU, NCCL, bfloat16 with float32 reduction): one
``meshpilot train`` run and one ``torchrun bench/torchrun_reference.py`` run of the same job,
side by side. Tokens/s is the global batch's tokens over the steady step time (the median gap
between step completions after warm-up); MFU divides the model FLOPs that rate implies by the
GPUs' dense bf16 peak (``metrics.device_peak_tflops`` or the known device's). The last stdout
line is one JSON object. Without CUDA it exits 2 with one line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import REPO, emit, steady_step_time  # noqa: E402
from bench.overhead import measure_meshpilot, measure_torchrun  # noqa: E402
from orchestrator.config import JobConfig, load_config  # noqa: E402
from orchestrator.errors import UserError  # noqa: E402
from orchestrator.observe.metric_names import peak_flops  # noqa: E402

DEMO_CONFIG = REPO / "configs" / "tiny-3d.yaml"
# Per preset: sequence length, sequences per GPU per step, and the data (the 1B model's
# vocabulary is far beyond the demo text's bytes, so it trains on synthetic tokens).
PRESETS: dict[str, dict[str, Any]] = {
    "debug": {"seq_len": 256, "per_gpu_batch": 8, "data": "text"},
    "llama3-1b": {"seq_len": 2048, "per_gpu_batch": 2, "data": "synthetic"},
}


def job_config(preset: str, gpus: int, extra: tuple[str, ...] = ()) -> JobConfig:
    """The preset's job on ``gpus`` GPUs; ``extra`` overrides come last (``--set``)."""
    shape = PRESETS[preset]
    return load_config(
        DEMO_CONFIG,
        [
            f"model.preset={preset}",
            f"data.source={shape['data']}",
            f"data.path={REPO / 'data' / 'sample.txt'}",
            "parallelism.dp_replicate=1",
            f"parallelism.dp_shard={gpus}",
            "parallelism.tp=1",
            "parallelism.pp=1",
            "parallelism.microbatches=1",
            f"training.global_batch={shape['per_gpu_batch'] * gpus}",
            f"training.seq_len={shape['seq_len']}",
            "runtime.gpus_per_rank=1",
            "runtime.cpus_per_rank=1",
            # torchrun keeps no peer-memory snapshots: like with like (`--set
            # elastic.snapshot_interval_steps=1` measures what they cost).
            "elastic.snapshot_interval_steps=0",
            *extra,
        ],
    )


def throughput(config: JobConfig, completions: list[float], warmup: int, gpus: int, peak: float | None) -> dict:
    """Tokens/s and MFU from step completion times (all GPUs of the job together)."""
    step_s = steady_step_time(completions, warmup)
    tokens_per_s = config.training.global_batch * config.training.seq_len / step_s
    flops_per_token = config.model_spec.flops_per_token(config.training.seq_len)
    mfu = tokens_per_s * flops_per_token / (gpus * peak) if peak else None
    return {"step_s": round(step_s, 4), "tokens_per_s": round(tokens_per_s, 1), "mfu": mfu and round(mfu, 4)}


def measure_preset(
    preset: str, gpus: int, steps: int, warmup: int, peak: float | None, workdir: Path, extra: tuple[str, ...] = ()
) -> dict:
    """One meshpilot run and one torchrun run of the preset; their figures and the ratio."""
    config = job_config(preset, gpus, extra)
    config_path = workdir / f"{preset}.yaml"
    config_path.write_text(config.to_yaml())
    run_dir = workdir / preset
    run_dir.mkdir()
    _, reference = measure_torchrun(config_path, steps, gpus, run_dir)
    _, ours, _ = measure_meshpilot(config_path, steps, run_dir)
    figures = {
        "meshpilot": throughput(config, [r["completed_at"] for r in ours], warmup, gpus, peak),
        "torchrun": throughput(config, [r["completed_at"] for r in reference], warmup, gpus, peak),
    }
    ratio = figures["meshpilot"]["tokens_per_s"] / figures["torchrun"]["tokens_per_s"]
    print(
        f"{preset}: meshpilot {figures['meshpilot']['tokens_per_s']:,.0f} tokens/s "
        f"(MFU {figures['meshpilot']['mfu']}) vs torchrun {figures['torchrun']['tokens_per_s']:,.0f} tokens/s "
        f"(MFU {figures['torchrun']['mfu']}): x{ratio:.3f}",
        flush=True,
    )
    return {
        **figures,
        "tokens_per_s_ratio": round(ratio, 3),
        "global_batch": config.training.global_batch,
        "seq_len": config.training.seq_len,
        "params": config.model_spec.num_params,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 steps per run instead of 40")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, repeatable")
    args = parser.parse_args()
    extra = tuple(args.set)
    try:  # a bad --set gets one line before any GPU or run is touched
        for preset in args.presets:
            job_config(preset, 1, extra)
    except UserError as error:
        print(f"bench/gpu.py: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print(f"bench/gpu.py needs CUDA GPUs; torch {torch.__version__} sees none", file=sys.stderr)
        raise SystemExit(2)
    device_name = torch.cuda.get_device_name(0)
    peak = peak_flops(load_config(DEMO_CONFIG).metrics.device_peak_tflops, device_name)
    steps, warmup = (12, 3) if args.quick else (40, 5)
    with tempfile.TemporaryDirectory() as tmp:
        presets = {
            preset: measure_preset(preset, gpus, steps, warmup, peak, Path(tmp), extra) for preset in args.presets
        }
    emit(
        {
            "benchmark": "gpu",
            "quick": args.quick,
            "device": device_name,
            "gpus": gpus,
            "peak_tflops_per_gpu": peak and peak / 1e12,
            "steps": steps,
            "warmup_steps": warmup,
            "overrides": list(extra),
            "presets": presets,
        }
    )


if __name__ == "__main__":
    main()
