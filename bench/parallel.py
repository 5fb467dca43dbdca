"""Pipeline bubble, measured: 1F1B vs zero-bubble at pp=2 and pp=4 with the same microbatches;
and a mixture of experts' tokens/s with ep=1 vs ep=2 on two data-parallel ranks.

    python bench/parallel.py [--quick] [--microbatches 8] [--schedules 1f1b,zero_bubble,zbv] [--parts bubble,experts]

For each pp and schedule, ``pp`` spawned gloo processes (no Ray) train the same model with the
rank's own ``Trainer``; every PipelineStage's forward, backward and weight-gradient calls are
timed on each rank. A rank's idle fraction is 1 - (time inside those calls) / (the step's
forward-backward time): what it spent waiting on its neighbours, the bubble (plus the sends and
receives, which gloo runs on the calling thread). Reported per rank and as the mean over ranks
after warm-up, next to the planner's formula (``elastic.pipeline_cost.pipeline_bubble``).

Each process gets ``cores // pp`` threads; with fewer cores than ranks the ranks' compute
overlaps on shared cores and the idle fractions read low (the JSON records the core count).

Experts: two spawned gloo ranks train the same mixture of experts on dp_shard=2, once with every
rank holding all experts (ep=1: FSDP gathers them) and once with each holding half (ep=2: tokens
travel to their experts by all-to-all), in alternating rounds; tokens/s is the global batch over
the median step time after warm-up.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402

from bench.common import emit, spawn_ranks  # noqa: E402
from checkpointing.torch_compat import REDISTRIBUTE_LOGGER  # noqa: E402
from elastic.pipeline_cost import pipeline_bubble  # noqa: E402
from elastic.spec import MeshSpec  # noqa: E402
from workers.data import SyntheticSource  # noqa: E402
from workers.runtime import init_generation  # noqa: E402
from workers.spec import MoeArgs, TrainSpec, model_spec  # noqa: E402
from workers.spec.pipeline import RULES, PipelineSchedule  # noqa: E402
from workers.trainer import Trainer  # noqa: E402

WARMUP_STEPS = 2
# 8 layers: pp=4 with two stages per rank still gives every stage a layer.
MODEL = model_spec("debug", dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=512)
STAGE_CALLS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
# 16 experts of width 512, top-2, on dim 256: the experts hold most of the parameters, as in the
# mixtures people train, so ep=2 halves what each rank gathers.
MOE_MODEL = cast(
    MoeArgs,
    model_spec(
        "debug-moe", dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512, n_experts=16, moe_ffn_dim=512
    ),
)


def _time_stage_calls(busy: list[float]) -> None:
    """Wrap PipelineStage's compute calls (in this process only) to add their time to ``busy[0]``."""
    for name in STAGE_CALLS:
        original = getattr(PipelineStage, name)

        @functools.wraps(original)
        def timed(self: PipelineStage, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return __original(self, *args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - started

        setattr(PipelineStage, name, timed)


def run_rank(case: dict[str, Any], rank: int, store_path: str, results: Any) -> None:
    """One pipeline rank: ``case["steps"]`` steps; sends back (rank, idle fractions after warm-up)."""
    pp, schedule = case["pp"], case["schedule"]
    torch.set_num_threads(case["threads"])
    init_generation(
        store=dist.FileStore(store_path, pp), generation=0, rank=rank, world_size=pp, backend="gloo", timeout_s=300
    )
    busy = [0.0]
    _time_stage_calls(busy)
    spec = TrainSpec(
        model=MODEL,
        steps=case["steps"],
        global_batch=case["microbatches"] * case["microbatch_size"],
        seq_len=case["seq_len"],
        microbatch_size=case["microbatch_size"],
        microbatches=case["microbatches"],
        pp_schedule=schedule,
        stages_per_rank=RULES[PipelineSchedule(schedule)].default_stages_per_rank,
    )
    source = SyntheticSource(vocab_size=MODEL.vocab_size, seq_len=spec.seq_len, seed=0)
    trainer = Trainer(spec, MeshSpec(dp_shard=1, tp=1, pp=pp), rank, device=torch.device("cpu"), source=source)
    trainer.init_weights()
    idle = []
    for step in range(1, spec.steps + 1):
        busy[0] = 0.0
        result = trainer.train_step(step)
        idle.append(1.0 - busy[0] / result.phases["compute_s"])
    _send_and_exit(results, rank, idle[WARMUP_STEPS:])


def measure(case: dict[str, Any]) -> dict[str, Any]:
    """Spawn the case's ranks; their idle fractions and the formula's bubble."""
    outcomes = spawn_ranks(run_rank, case, case["pp"])
    per_rank = [statistics.median(outcomes[rank]) for rank in range(case["pp"])]
    virtual = RULES[PipelineSchedule(case["schedule"])].default_stages_per_rank
    return {
        "pp": case["pp"],
        "schedule": case["schedule"],
        "stages_per_rank": virtual,
        "microbatches": case["microbatches"],
        "measured_bubble": round(statistics.mean(per_rank), 4),
        "measured_bubble_per_rank": [round(value, 4) for value in per_rank],
        "formula_bubble": round(pipeline_bubble(case["pp"], case["microbatches"], virtual, case["schedule"]), 4),
    }


def run_expert_rank(case: dict[str, Any], rank: int, store_path: str, results: Any) -> None:
    """One of two dp_shard ranks of the mixture of experts; sends back (rank, step seconds after warm-up)."""
    torch.set_num_threads(case["threads"])
    logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)  # as the rank actors do
    init_generation(
        store=dist.FileStore(store_path, 2), generation=0, rank=rank, world_size=2, backend="gloo", timeout_s=300
    )
    spec = TrainSpec(
        model=MOE_MODEL,
        steps=case["steps"],
        global_batch=case["global_batch"],
        seq_len=case["seq_len"],
        microbatch_size=case["global_batch"] // 2,
        ep=case["ep"],
    )
    source = SyntheticSource(vocab_size=MOE_MODEL.vocab_size, seq_len=spec.seq_len, seed=0)
    trainer = Trainer(spec, MeshSpec(dp_shard=2), rank, device=torch.device("cpu"), source=source)
    trainer.init_weights()
    seconds = []
    for step in range(1, spec.steps + 1):
        started = time.perf_counter()
        trainer.train_step(step)
        seconds.append(time.perf_counter() - started)
    _send_and_exit(results, rank, seconds[WARMUP_STEPS:])


def _send_and_exit(results: Any, rank: int, values: list[float]) -> None:
    """Hand the parent this rank's figures, wait for the other ranks, and leave without teardown."""
    results.put((rank, values))
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)


def measure_experts(case: dict[str, Any], rounds: int) -> dict[str, Any]:
    """tokens/s of ep=1 and ep=2 in alternating rounds: (the step's slowest rank) per step, median."""
    tokens = case["global_batch"] * case["seq_len"]
    steps: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(rounds):
        for ep in (1, 2):
            outcomes = spawn_ranks(run_expert_rank, {**case, "ep": ep}, 2)
            steps[ep].extend(max(pair) for pair in zip(outcomes[0], outcomes[1]))
    per_ep = {ep: tokens / statistics.median(seconds) for ep, seconds in steps.items()}
    return {
        "model": {"n_experts": MOE_MODEL.n_experts, "top_k": MOE_MODEL.top_k_experts, "params": MOE_MODEL.num_params},
        "tokens_per_step": tokens,
        "rounds": rounds,
        "tokens_per_s_ep1": round(per_ep[1], 1),
        "tokens_per_s_ep2": round(per_ep[2], 1),
        "ratio_ep2_over_ep1": round(per_ep[2] / per_ep[1], 4),
        "step_s_ep1": [round(value, 4) for value in steps[1]],
        "step_s_ep2": [round(value, 4) for value in steps[2]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default="1f1b,zero_bubble", help="comma-separated pp_schedule names")
    parser.add_argument("--pp", default="2,4", help="comma-separated pipeline degrees")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--parts", default="bubble,experts", help="what to measure: bubble, experts or both")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"bubble", "experts"}:
        print(f"bench/parallel.py: --parts={args.parts!r}: name bubble, experts or both", file=sys.stderr)
        raise SystemExit(2)
    cores = os.cpu_count() or 1
    steps = WARMUP_STEPS + (3 if args.quick else 10)
    rows = []
    for pp in (int(value) for value in args.pp.split(",")) if "bubble" in parts else ():
        for schedule in args.schedules.split(","):
            case = {
                "pp": pp,
                "schedule": schedule,
                "steps": steps,
                "microbatches": args.microbatches,
                "microbatch_size": 2,
                "seq_len": args.seq_len,
                "threads": max(1, cores // pp),
            }
            row = measure(case)
            print(
                f"pp={pp} {schedule:<12} v={row['stages_per_rank']} m={row['microbatches']}: measured bubble "
                f"{row['measured_bubble']:.1%} (per rank {row['measured_bubble_per_rank']}), "
                f"formula {row['formula_bubble']:.1%}",
                flush=True,
            )
            rows.append(row)
    experts = None
    if "experts" in parts:
        case = {"steps": steps, "global_batch": 8, "seq_len": args.seq_len, "threads": max(1, cores // 2)}
        experts = measure_experts(case, rounds=1 if args.quick else 3)
        print(
            f"experts on dp_shard=2: ep=1 {experts['tokens_per_s_ep1']:.0f} tokens/s, ep=2 "
            f"{experts['tokens_per_s_ep2']:.0f} tokens/s ({experts['ratio_ep2_over_ep1']:.2f}x)",
            flush=True,
        )
    emit(
        {
            "benchmark": "parallel",
            "cores": cores,
            "steps_measured": steps - WARMUP_STEPS,
            "cases": rows,
            "experts": experts,
        }
    )


if __name__ == "__main__":
    main()
