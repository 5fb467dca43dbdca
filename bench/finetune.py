"""Fine-tuning costs, measured: LoRA against full fine-tuning of the same model on the same mesh,
and packing by documents against windows on the same masked corpus.

    python bench/finetune.py [--quick] [--parts lora,packing] [--rank 16] [--layers 2] [--steps 5] [--device cpu|cuda]

Two spawned ranks (gloo on CPU, NCCL on GPUs; no Ray) train the Llama-3.2-1B layer shapes (dim
2048, 32 query / 8 key-value heads, SwiGLU width 8192; ``--layers`` of them and a 32,768-token
vocabulary with ``--quick``, 128,256 without) on dp_shard=2, once with every weight training (full
fine-tuning: AdamW over everything) and once with LoRA adapters of ``--rank`` on the attention
projections beside a frozen base, each in fresh processes. Reported per configuration: the median
step time after warm-up, tokens/s, and each rank's peak memory while it trains (on CUDA
``torch.cuda.max_memory_allocated`` from the first step; on CPU the largest resident set sampled
every 5 ms during the steps, less the resident set before the trainer was built, after handing
the memory initialisation freed back to the system), next to the bytes of its model state
(parameters, gradients, optimizer state; exact). The JSON's ``lora_over_full`` ratios are the
figures: peak memory <= 0.5 and tokens/s >= 1 are the goals.

Packing: a prompt-completion corpus (documents of 8 to 600 tokens, the first half of each a prompt
that does not train; written by ``tests/token_corpus.py`` straight through the format module) is
trained on the same two ranks with ``data.packing: windows`` (windows of the token stream across
documents, masked labels) and ``documents`` (whole documents per sample, positions restarting,
attention fenced by a block-diagonal mask, no label across a seam). The figure is trained tokens
(labels that count in the loss) per second, documents over windows; the goal is >= 0.9.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import emit, spawn_ranks  # noqa: E402
from checkpointing.storage import open_storage  # noqa: E402
from elastic.spec import MeshSpec  # noqa: E402
from tests.token_corpus import documents, prompt_masks, write_corpus  # noqa: E402
from workers.data import SampleSource, SyntheticSource  # noqa: E402
from workers.parallelize import local_slice  # noqa: E402
from workers.runtime import init_generation  # noqa: E402
from workers.spec import TrainSpec, model_spec  # noqa: E402
from workers.spec.lora import LoraSpec  # noqa: E402
from workers.spec.tokens import CorpusFormat, Packing  # noqa: E402
from workers.spec.train import TokenCorpusSource  # noqa: E402
from workers.token_source import TokenSource  # noqa: E402
from workers.trainer import Trainer  # noqa: E402

WARMUP_STEPS = 1
RANKS = 2


def one_b_shapes(*, layers: int, vocab_size: int):
    """The Llama-3.2-1B preset's layer shapes with fewer layers (and a smaller vocabulary)."""
    return model_spec("llama3-1b", n_layers=layers, vocab_size=vocab_size)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakResident:
    """The largest resident set of this process, sampled on a thread while ``with`` is open (CPU)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.peak = 0
        self._interval_s = interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(self._interval_s):
            self.peak = max(self.peak, _resident_bytes())

    def __enter__(self) -> PeakResident:
        self.peak = _resident_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def _state_bytes(trainer: Trainer) -> int:
    """This rank's bytes of parameters, gradients and optimizer state (its shards)."""
    total = 0
    for module in trainer.modules:
        for param in module.parameters():
            local = local_slice(param)
            total += local.numel() * local.element_size() * (2 if param.requires_grad else 1)
            for value in trainer.optimizer.state.get(param, {}).values():
                total += local_slice(value).numel() * local_slice(value).element_size()
    return total


def run_rank(case: dict[str, Any], rank: int, store_path: str, results: Any) -> None:
    """One of the two dp_shard ranks: sends back (rank, step seconds after warm-up, peak bytes)."""
    device = torch.device(case["device"], rank) if case["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(case["threads"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    init_generation(
        store=dist.FileStore(store_path, RANKS),
        generation=0,
        rank=rank,
        world_size=RANKS,
        backend=backend,
        timeout_s=600,
    )
    spec = TrainSpec(
        model=case["model"],
        steps=case["steps"],
        global_batch=case["global_batch"],
        seq_len=case["seq_len"],
        microbatch_size=case["global_batch"] // RANKS,
        dtype="bfloat16" if device.type == "cuda" else "float32",
        backend=backend,
        lora=case["lora"],
    )
    source: SampleSource
    if case.get("corpus"):
        source = TokenSource(TokenCorpusSource(case["corpus"], packing=case["packing"]), seq_len=spec.seq_len, seed=0)
    else:
        source = SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=0)
    baseline = _resident_bytes()
    trainer = Trainer(spec, MeshSpec(dp_shard=RANKS), rank, device=device, source=source)
    trainer.init_weights()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what initialisation freed is not the training's memory
    seconds, trained = [], []
    with PeakResident() as resident:
        for step in range(1, spec.steps + 1):
            started = time.perf_counter()
            result = trainer.train_step(step)
            seconds.append(time.perf_counter() - started)
            trained.append(result.trained_tokens)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else resident.peak - baseline
    source.close()
    results.put((rank, (seconds[WARMUP_STEPS:], peak, _state_bytes(trainer), trained[WARMUP_STEPS:])))
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)


def measure(case: dict[str, Any]) -> dict[str, Any]:
    """Step time (the slower rank's, per step, median), tokens/s and per-rank peak memory of one case."""
    outcomes = spawn_ranks(run_rank, case, RANKS, timeout_s=1800)
    steps = [max(pair) for pair in zip(*(outcomes[rank][0] for rank in range(RANKS)))]
    step_s = statistics.median(steps)
    tokens = case["global_batch"] * case["seq_len"]
    trained = outcomes[0][3]  # the global batch's trained labels, the same on every rank
    return {
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1),
        "trained_tokens_per_s": round(sum(trained) / sum(steps), 1),
        "trained_share": round(sum(trained) / (tokens * len(trained)), 4),
        "peak_memory_mb_per_rank": [round(outcomes[rank][1] / 2**20, 1) for rank in range(RANKS)],
        "state_mb_per_rank": [round(outcomes[rank][2] / 2**20, 1) for rank in range(RANKS)],
    }


def compare_lora(args: argparse.Namespace, device: str, threads: int) -> dict[str, Any]:
    """Full fine-tuning, then LoRA, each in fresh processes, on the same model, batch and mesh."""
    model = one_b_shapes(layers=args.layers, vocab_size=32768 if args.quick else 128256)
    case = {
        "device": device,
        "threads": threads,
        "model": model,
        "steps": WARMUP_STEPS + args.steps,
        "global_batch": args.global_batch,
        "seq_len": args.seq_len,
    }
    lora = LoraSpec(rank=args.rank, alpha=2.0 * args.rank)
    full = measure({**case, "lora": None})
    print(f"full fine-tuning: {full}", flush=True)
    adapted = measure({**case, "lora": lora})
    print(f"LoRA rank {args.rank} ({', '.join(lora.target_modules)}): {adapted}", flush=True)
    peak_full, peak_lora = max(full["peak_memory_mb_per_rank"]), max(adapted["peak_memory_mb_per_rank"])
    return {
        "model": {"shapes": "llama3-1b layers", **{k: getattr(model, k) for k in ("dim", "n_layers", "vocab_size")}},
        "params": model.num_params,
        "lora": dataclasses.asdict(lora),
        "mesh": {"dp_shard": RANKS},
        "global_batch": args.global_batch,
        "seq_len": args.seq_len,
        "full": full,
        "lora_run": adapted,
        "lora_over_full": {
            "peak_memory": round(peak_lora / peak_full, 4),
            "state": round(max(adapted["state_mb_per_rank"]) / max(full["state_mb_per_rank"]), 4),
            "tokens_per_s": round(adapted["tokens_per_s"] / full["tokens_per_s"], 4),
        },
    }


def compare_packing(args: argparse.Namespace, device: str, threads: int, workdir: str) -> dict[str, Any]:
    """Windows, then documents, each in fresh processes, on the same masked corpus, model and mesh."""
    vocab_size = 4096
    stream = documents(3000 if args.quick else 12000, vocab_size=vocab_size, seed=1, max_length=600)
    held_out = documents(50, vocab_size=vocab_size, seed=2, max_length=600)
    corpus_dir = str(Path(workdir) / "corpus")
    write_corpus(
        open_storage(corpus_dir),
        train=stream,
        validation=held_out,
        vocab_size=vocab_size,
        shard_tokens=1 << 20,
        masks=(prompt_masks(stream), prompt_masks(held_out)),
        corpus_format=CorpusFormat.PROMPT_COMPLETION,
    )
    model = model_spec("debug", dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1536, vocab_size=vocab_size)
    case = {
        "device": device,
        "threads": threads,
        "model": model,
        "lora": None,
        "steps": WARMUP_STEPS + args.steps,
        "global_batch": 8,
        "seq_len": args.packing_seq_len,
        "corpus": corpus_dir,
    }
    windows = measure({**case, "packing": Packing.WINDOWS})
    print(f"windows: {windows}", flush=True)
    packed = measure({**case, "packing": Packing.DOCUMENTS})
    print(f"documents: {packed}", flush=True)
    return {
        "model": {k: getattr(model, k) for k in ("dim", "n_layers", "vocab_size")},
        "seq_len": case["seq_len"],
        "global_batch": case["global_batch"],
        "windows": windows,
        "documents": packed,
        "documents_over_windows": {
            "trained_tokens_per_s": round(packed["trained_tokens_per_s"] / windows["trained_tokens_per_s"], 4),
            "step_s": round(packed["step_s"] / windows["step_s"], 4),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, a 32k vocabulary, 3 steps (a smoke run)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 2 with --quick, else 4)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps after warm-up (default 3 / 5)")
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--parts", default="lora,packing", help="what to measure: lora, packing or both")
    parser.add_argument("--packing-seq-len", type=int, default=1024, help="seq_len of the packing comparison")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"lora", "packing"}:
        print(f"bench/finetune.py: --parts={args.parts!r}: name lora, packing or both", file=sys.stderr)
        raise SystemExit(2)
    args.layers = args.layers or (2 if args.quick else 4)
    args.steps = args.steps or (3 if args.quick else 5)
    if args.device == "cuda" and torch.cuda.device_count() < RANKS:
        print(f"bench/finetune.py: --device cuda needs {RANKS} GPUs; use --device cpu", file=sys.stderr)
        raise SystemExit(2)
    cores = os.cpu_count() or 1
    threads = max(1, cores // RANKS)
    lora = compare_lora(args, args.device, threads) if "lora" in parts else None
    packing = None
    if "packing" in parts:
        with tempfile.TemporaryDirectory() as workdir:
            packing = compare_packing(args, args.device, threads, workdir)
    emit({"benchmark": "finetune", "device": args.device, "cores": cores, "lora_vs_full": lora, "packing": packing})


if __name__ == "__main__":
    main()
