"""Long context: the three context-parallel methods (``parallelism.cp_method``) measured against
each other and against the planner.

    python bench/long_context.py [--quick] [--gpu]

Steps: at cp=2 and cp=4, ``cp`` spawned gloo processes (no Ray) train the debug model on
sequences of ``--seq-len`` tokens with each method in turn (the rank's own ``Trainer``, one
thread per rank); the best step time after warm-up and each rank's peak resident memory
(``ru_maxrss``, the whole process) per method, and the ratios ring / allgather and ulysses /
allgather of the same run.

Memory: at 16K tokens, per method and cp, each rank runs the debug model's forward over its
part of one sequence and counts the bytes autograd keeps for the backward inside the decoder
layers (``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters left out):
the activations and the keys/values the method keeps. The planner's figure for the same layout
(``elastic.cost_model``: the family's saved activations per token plus
``layer_traffic.cp_attention_bytes``' kept keys and values) is in bf16; the run is float32, so
the measured bytes are halved before the comparison (the goal: within 20%).

``--gpu`` (a CUDA GPU): one rank's attention kernel at 32K tokens (Llama 3 8B's heads, bf16,
forward + backward) with the causal kernel and with a document mask (8 documents), the times
each; no ranks, no cp. Without CUDA it says so in the JSON and measures nothing.

Cores: ranks share the machine's cores, so on 2 cores the cp=4 times include waiting for a core;
the ratios compare methods on the same layout.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import emit, spawn_ranks  # noqa: E402
from elastic.cost_model import Cluster, Layout, Workload, estimate  # noqa: E402
from elastic.hardware import gpu_spec  # noqa: E402
from elastic.layer_traffic import cp_attention_bytes  # noqa: E402
from elastic.memory_model import activation_bytes_per_token  # noqa: E402
from elastic.spec import CpMethod, MeshSpec  # noqa: E402
from workers.spec import TrainSpec, model_spec  # noqa: E402

METHODS = tuple(CpMethod)
CP_DEGREES = (2, 4)
MEMORY_SEQ_LEN = 16384
GPU_SEQ_LEN = 32768
WARMUP_STEPS = 1


def debug_model(seq_len: int) -> Any:
    return model_spec("debug", max_seq_len=max(seq_len, 2048))


def _join(rank: int, store_path: str, world_size: int) -> None:
    from workers.runtime import init_generation

    init_generation(
        store=dist.FileStore(store_path, world_size),
        generation=0,
        rank=rank,
        world_size=world_size,
        backend="gloo",
        timeout_s=600,
    )


def _send_and_exit(results: Any, rank: int, value: dict[str, Any]) -> None:
    """Hand ``value`` to the parent (flushed before leaving), wait for the other ranks, exit without teardown."""
    results.put((rank, value))
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)


def step_rank(case: dict[str, Any], rank: int, store_path: str, results: Any) -> None:
    """In a spawned rank: train ``case["steps"]`` steps with one cp method; report step times and peak RSS."""
    from workers.data import SyntheticSource
    from workers.trainer import Trainer

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    mesh = MeshSpec(dp_shard=1, cp=case["cp"])
    _join(rank, store_path, mesh.world_size)
    spec = TrainSpec(
        model=debug_model(case["seq_len"]),
        steps=case["steps"],
        global_batch=1,
        seq_len=case["seq_len"],
        microbatch_size=1,
        microbatches=1,
        cp_method=CpMethod(case["method"]),
    )
    source = SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=0)
    trainer = Trainer(spec, mesh, rank, device=torch.device("cpu"), source=source)
    trainer.init_weights()
    times = []
    for step in range(1, case["steps"] + 1):
        started = time.perf_counter()
        trainer.train_step(step)
        times.append(time.perf_counter() - started)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    _send_and_exit(results, rank, {"times": times, "peak_rss": peak_rss})


def memory_rank(case: dict[str, Any], rank: int, store_path: str, results: Any) -> None:
    """In a spawned rank: one forward of the debug model over this rank's part of a sequence;
    the bytes autograd keeps inside the decoder layers."""
    from workers.context_parallel import SequenceShard
    from workers.initial_values import init_weights
    from workers.models import resolve_family
    from workers.parallelize import apply_context_parallel

    torch.set_num_threads(1)
    cp, seq_len = case["cp"], case["seq_len"]
    _join(rank, store_path, cp)
    spec = debug_model(seq_len)
    family = resolve_family(spec.family)
    model = family.build(spec)
    init_weights(model, family, spec, seed=0)
    shard = SequenceShard(cp=cp, cp_rank=rank, group=dist.group.WORLD, method=CpMethod(case["method"]))
    apply_context_parallel(model, shard)
    tokens = shard.take(torch.randint(0, spec.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0)))
    parameters = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    seen: set[int] = set()
    counting = [False]
    kept = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if counting[0] and storage.data_ptr() not in parameters and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            kept[0] += storage.nbytes()
        return tensor

    for layer in model.layers.values():
        layer.register_forward_pre_hook(lambda *_: counting.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: counting.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens)
    _send_and_exit(results, rank, {"kept_bytes": kept[0]})


def planner_kept_bytes(cp: int, method: CpMethod, seq_len: int) -> tuple[float, float]:
    """The planner's bytes for one sequence of ``seq_len`` on cp ranks: (kept for the backward over
    every layer, its whole activation figure), bf16."""
    model = debug_model(seq_len)
    layout = Layout(MeshSpec(dp_shard=1, cp=cp), microbatches=1, cp_method=method)
    tokens = seq_len // cp
    kept_kv, _ = cp_attention_bytes(Workload(model, seq_len, 1), layout, tokens)
    kept = model.n_layers * (tokens * activation_bytes_per_token(model) + kept_kv)
    whole = estimate(Workload(model, seq_len, 1), Cluster(cp, cp, gpu_spec()), layout).memory.activations
    return kept, whole


def measure_steps(seq_len: int, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cp in CP_DEGREES:
        per_method = {}
        for method in METHODS:
            case = {"cp": cp, "method": str(method), "seq_len": seq_len, "steps": steps}
            ranks = spawn_ranks(step_rank, case, cp)
            # The best step after warm-up (the slowest rank's): ranks share the cores with whatever
            # else runs, and the best step is the one least disturbed by it.
            step_s = min(max(ranks[r]["times"][i] for r in ranks) for i in range(WARMUP_STEPS, steps))
            peak = max(ranks[r]["peak_rss"] for r in ranks)
            per_method[str(method)] = {"step_s": round(step_s, 4), "peak_rss_mb": round(peak / 2**20, 1)}
            print(f"cp={cp} {method:<9} step {step_s:.3f} s  peak RSS {peak / 2**20:.0f} MB per rank", flush=True)
        base = per_method["allgather"]
        for name in ("ring", "ulysses"):
            per_method[f"{name}_over_allgather"] = {
                "step_time": round(per_method[name]["step_s"] / base["step_s"], 3),
                "peak_rss": round(per_method[name]["peak_rss_mb"] / base["peak_rss_mb"], 3),
            }
        out[f"cp{cp}"] = per_method
    return out


def measure_memory(seq_len: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cp in CP_DEGREES:
        for method in METHODS:
            ranks = spawn_ranks(memory_rank, {"cp": cp, "method": str(method), "seq_len": seq_len}, cp)
            measured_fp32 = max(value["kept_bytes"] for value in ranks.values())
            measured = measured_fp32 / 2  # float32 run, the planner counts bf16
            planned, whole = planner_kept_bytes(cp, method, seq_len)
            out[f"cp{cp}-{method}"] = {
                "measured_kept_mb_bf16": round(measured / 2**20, 2),
                "planner_kept_mb": round(planned / 2**20, 2),
                "planner_activations_mb": round(whole / 2**20, 2),
                "measured_over_planner": round(measured / planned, 3),
            }
            print(
                f"{seq_len} tokens cp={cp} {method:<9} kept {measured / 2**20:.1f} MB (bf16 equivalent) vs planner "
                f"{planned / 2**20:.1f} MB: {measured / planned:.2f}x",
                flush=True,
            )
    return out


def measure_gpu_kernel(seq_len: int) -> dict[str, Any]:
    """One rank's attention at ``seq_len`` tokens on CUDA, causal kernel vs a document mask."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    from workers.context_parallel import WHOLE_SEQUENCE, document_mask, local_attention

    device = torch.device("cuda")
    heads, kv_heads, head_dim = 32, 8, 128  # Llama 3 8B
    generator = torch.Generator(device=device).manual_seed(0)

    def tensor(n_heads: int) -> torch.Tensor:
        shape = (1, n_heads, seq_len, head_dim)
        return torch.randn(shape, device=device, dtype=torch.bfloat16, generator=generator).requires_grad_()

    q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)
    documents = torch.arange(seq_len, device=device)[None, :] * 8 // seq_len  # 8 documents
    masks = {"causal": None, "documents": document_mask(documents, WHOLE_SEQUENCE)}
    out: dict[str, Any] = {"seq_len": seq_len, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    for name, mask in masks.items():
        times = []
        for _ in range(4):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            local_attention(q, k, v, mask).sum().backward()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[f"{name}_fwd_bwd_s"] = round(statistics.median(times[1:]), 5)
        print(f"GPU attention {seq_len} tokens, {name}: {out[f'{name}_fwd_bwd_s'] * 1e3:.1f} ms forward + backward")
    out["documents_over_causal"] = round(out["documents_fwd_bwd_s"] / out["causal_fwd_bwd_s"], 3)
    out["device"] = torch.cuda.get_device_name()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short sequences and few steps (a smoke run)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence of the step part")
    parser.add_argument("--gpu", action="store_true", help="only the single-GPU attention kernel at 32K tokens")
    args = parser.parse_args()
    if args.gpu:
        emit({"bench": "long_context_gpu", "kernel": measure_gpu_kernel(GPU_SEQ_LEN)})
        return
    seq_len = args.seq_len or (2048 if args.quick else 8192)
    steps = 4 if args.quick else 8
    result = {
        "bench": "long_context",
        "cores": os.cpu_count(),
        "seq_len": seq_len,
        "steps": steps,
        "step": measure_steps(seq_len, steps),
        "memory_seq_len": MEMORY_SEQ_LEN,
        "memory": measure_memory(MEMORY_SEQ_LEN),
    }
    emit(result)


if __name__ == "__main__":
    main()
