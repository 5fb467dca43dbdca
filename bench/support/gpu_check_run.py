"""One training run of the GPU check's throughput part, in a process of its own, one rank, no Ray.

    python -m bench.support.gpu_check_run --side ours --preset llama3-1b --mode compiled
    python -m bench.support.gpu_check_run --side reference --preset debug --mode eager --steps 4 --warmup 1

``ours``: this repository's Trainer, as ``bench/torchrun_reference.py`` runs it (world size 1,
NCCL on CUDA, gloo on the CPU), with ``training.compile`` / ``training.float8`` set by the mode.
``reference``: a plain FSDP2 loop over ``transformers``' ``LlamaForCausalLM`` with TorchTitan's
recipe (each decoder layer ``fully_shard``-ed then the root; each layer compiled; torchao's
tensorwise float8 with FSDP2's float8 all-gather on every linear layer but the output), the same
shape, the same tokens (our synthetic source), the same dtype policy (bfloat16 parameters,
float32 reduction on CUDA) and AdamW with the same settings (fused on CUDA, as ours). Prints one
JSON object, its last stdout line: the median step time after ``--warmup`` steps, tokens/s, peak
device memory, the losses.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.common import REPO, emit
from orchestrator.config import JobConfig, load_config
from orchestrator.errors import UserError

DEMO_CONFIG = REPO / "configs" / "tiny-3d.yaml"
MODES = {"eager": (False, False), "compiled": (True, False), "compiled_float8": (True, True)}


def job_config(
    preset: str, *, n_layers: int | None, seq_len: int, batch: int, steps: int, mode: str, cuda: bool
) -> JobConfig:
    """The one-rank job both sides train: synthetic tokens, no snapshots, no checkpoints."""
    compile_, float8 = MODES[mode]
    return load_config(
        DEMO_CONFIG,
        [
            f"model.preset={preset}",
            *([f"model.n_layers={n_layers}"] if n_layers else []),
            "data.source=synthetic",
            "parallelism.dp_replicate=1",
            "parallelism.dp_shard=1",
            "parallelism.tp=1",
            "parallelism.pp=1",
            "parallelism.microbatches=1",
            f"training.global_batch={batch}",
            f"training.seq_len={seq_len}",
            f"training.steps={steps}",
            f"training.compile={str(compile_).lower()}",
            f"training.float8={str(float8).lower()}",
            f"runtime.gpus_per_rank={1 if cuda else 0}",
            "runtime.cpus_per_rank=1",
            "elastic.snapshot_interval_steps=0",
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("ours", "reference"), required=True)
    parser.add_argument("--preset", required=True)
    parser.add_argument("--n-layers", type=int, default=None)
    parser.add_argument("--mode", choices=list(MODES), default="eager")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    try:
        config = job_config(
            args.preset,
            n_layers=args.n_layers,
            seq_len=args.seq_len,
            batch=args.batch,
            steps=args.steps,
            mode=args.mode,
            cuda=cuda,
        )
    except UserError as error:  # e.g. float8 refused on this device: the run is skipped, with why
        emit({"status": "skipped", "reason": str(error)})
        return
    torch.set_num_threads(max(1, torch.get_num_threads()))
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    run = run_ours if args.side == "ours" else run_reference
    emit(run(config, device, warmup=args.warmup))


def one_rank_group(backend: str, device: torch.device, workdir: str) -> None:
    """A process group of this one process (a file store: no port to pick)."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"file://{workdir}/store",
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )


def run_ours(config: JobConfig, device: torch.device, *, warmup: int) -> dict[str, Any]:
    """meshpilot's Trainer on one rank, as the rank actors run it."""
    import torch.distributed as dist

    from orchestrator.driver.train_spec import train_spec
    from workers.runtime import make_source
    from workers.trainer import Trainer

    spec = train_spec(config)
    with tempfile.TemporaryDirectory() as workdir:
        one_rank_group(spec.backend, device, workdir)
        source = make_source(spec, None)
        started = time.perf_counter()
        trainer = Trainer(spec, config.mesh, 0, device=device, source=source)
        trainer.init_weights()
        built_s = time.perf_counter() - started
        times, losses = [], []
        for step in range(1, spec.steps + 1):
            result = trainer.train_step(step)
            times.append(result.step_time_s)
            losses.append(result.loss)
        trainer.close()
        source.close()
        dist.destroy_process_group()
    return figures(config, device, times, losses, warmup=warmup, built_s=built_s) | {
        "what": "meshpilot Trainer, one rank, no Ray",
        "dtype": spec.dtype,
    }


def run_reference(config: JobConfig, device: torch.device, *, warmup: int) -> dict[str, Any]:
    """The plain FSDP2 loop over ``LlamaForCausalLM`` (see the module docstring)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from orchestrator.driver.train_spec import train_spec
    from workers.data import local_batch
    from workers.runtime import make_source
    from workers.spec.families.llama_hf import llama_hf_config

    spec = train_spec(config)
    compile_, float8 = MODES["compiled_float8" if spec.float8 else "compiled" if spec.compile else "eager"]
    hf_config = LlamaConfig(**llama_hf_config(spec.model, dtype=spec.dtype))  # type: ignore[arg-type]
    hf_config._attn_implementation = "sdpa"
    with tempfile.TemporaryDirectory() as workdir:
        one_rank_group(spec.backend, device, workdir)
        started = time.perf_counter()
        with torch.device(device):
            # float32 parameters, as FSDP2's mixed precision (and our Trainer) keeps them sharded.
            model = LlamaForCausalLM(hf_config).float()
        if float8:
            convert_float8(model)
        layers = list(model.model.layers)
        if compile_:
            for layer in layers:  # per block, as TorchTitan's apply_compile
                layer.compile()
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
        bf16 = spec.dtype == "bfloat16"
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
        fully_shard(model, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
        parameters = list(model.parameters())
        optimizer = torch.optim.AdamW(
            parameters,
            lr=spec.lr,
            betas=(spec.beta1, spec.beta2),
            weight_decay=spec.weight_decay,
            fused=device.type == "cuda",
        )
        built_s = time.perf_counter() - started
        source = make_source(spec, None)
        times, losses = [], []
        for step in range(1, spec.steps + 1):
            began = time.perf_counter()
            batch = local_batch(source, step=step, global_batch=spec.global_batch, dp_rank=0, dp=1).to(device)
            logits = model(input_ids=batch.inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, spec.grad_clip, foreach=True)
            optimizer.step()
            if float8:  # the weights' float8 scales for the next step's all-gathers, in one pass
                from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

                precompute_float8_dynamic_scale_for_fsdp(model)
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.item()))  # .item() is a device sync point: the step is done
            times.append(time.perf_counter() - began)
        source.close()
        dist.destroy_process_group()
    return figures(config, device, times, losses, warmup=warmup, built_s=built_s) | {
        "what": "transformers LlamaForCausalLM, FSDP2 per layer, "
        + ("each layer compiled" if compile_ else "eager")
        + (", torchao float8 tensorwise" if float8 else ""),
        "dtype": spec.dtype,
    }


def convert_float8(model: torch.nn.Module) -> None:
    """torchao's float8 training on every linear layer but the output projection, as TorchTitan's
    float8 converter filters it (dimensions divisible by 16, ``lm_head`` left alone), with its
    tensorwise recipe and FSDP2's float8 all-gather (as ``training.float8`` runs it)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def wanted(module: torch.nn.Module, fqn: str) -> bool:
        if not isinstance(module, torch.nn.Linear) or fqn.endswith("lm_head"):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    filter_fn: Callable[[torch.nn.Module, str], bool] = wanted
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=filter_fn)


def figures(
    config: JobConfig,
    device: torch.device,
    times: list[float],
    losses: Sequence[float | None],
    *,
    warmup: int,
    built_s: float,
) -> dict[str, Any]:
    """Step time (median after the warm-up steps), tokens/s and peak memory of one run."""
    timed = times[warmup:] or times
    step_s = statistics.median(timed)
    tokens = config.training.global_batch * config.training.seq_len
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    return {
        "status": "measured",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params": config.model_spec.num_params,
        "tokens_per_step": tokens,
        "steps": len(times),
        "warmup_steps": warmup,
        "build_s": round(built_s, 3),
        "first_step_s": round(times[0], 4),
        "step_s": round(step_s, 5),
        "tokens_per_s": round(tokens / step_s, 1),
        "flops_per_token": config.model_spec.flops_per_token(config.training.seq_len),
        "peak_memory_bytes": peak,
        "peak_reserved_bytes": reserved,
        "losses": [None if loss is None else round(loss, 4) for loss in losses],
    }


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
