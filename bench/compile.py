"""Compile benchmark: ``training.compile`` against eager, and what compiling costs on a mesh change.

    python bench/compile.py             # more steps, 3 kill runs per setting (~5 min on 2 quiet cores)
    python bench/compile.py --quick     # fewer steps, 2 kill runs per setting (~4 min on 2 quiet cores)
    python bench/compile.py --keep DIR  # also keep the caches, artifacts and the Ray runs' events

CPU (inductor's C++ backend), float32, gloo. Measured, each figure beside its reference:

1. ``step``: one process, no Ray, world size 1: a Trainer of a model bigger than the debug
   preset (dim 256, 4 layers, seq_len 256) trains with each block compiled and without; the
   median steady step time of each (the first steps left out), and compiled over eager.
2. ``new_mesh``: the first step of a trainer on a layout against a later step of the same run,
   each case in a process of its own with its own inductor cache directory:
   (a) cold: an empty cache directory;
   (b) warm: the same process then leaves the generation (the trainer closed, dynamo's graphs
       kept as on any mesh without tp or cp: ``forget_compiled_graphs``, the process group
       rebuilt) and builds the layout again, as a surviving rank of an in-place recovery does;
   (c) joiner: a new process with an empty cache directory that first loads the artifacts (a)
       saved (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``), as a rank on
       a node whose disk never saw the layout does.
   With the graphs each case compiled and loaded in its first step (``StepResult.compiled``).
3. ``kill``: bench/recovery.py's SIGKILL of rank 3 at the start of step 8 on the Ray cluster
   (dp_replicate=2 x dp_shard=2, the debug model), compile on against off, runs alternating:
   the median fault to the first step on the new mesh, steps lost, and the ``compile`` field of
   that step's event (each simulated node has a cache directory of its own).
4. ``grow``: bench/recovery.py's node removed then a node added, compile on against off: from
   the node being up to the first step on the grown mesh, whose ranks on the new node load the
   artifacts the job published (their node's cache directory is empty).

The last stdout line is one JSON object with each figure, its reference and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, emit  # noqa: E402

BENCH = "bench/compile.py"
# The model of parts 1-2: enough compute per block that the compiled kernels show.
DIM, LAYERS, SEQ_LEN, BATCH = 256, 4, 256, 4
WARMUP_STEPS = 2  # left out of the steady figures: the first step compiles, the second settles
KILL_GOAL = 1.5  # kill -> first step with compile on over off
CASE_TIMEOUT_S = 600


# ------------------------------------------------------------------ parts 1-2: one process, no Ray
def case_spec(*, compile_on: bool, steps: int):
    """The TrainSpec of parts 1-2 (rank side: imports torch)."""
    from workers.spec import PRESETS, TrainSpec

    model = dataclasses.replace(PRESETS["debug"], dim=DIM, n_layers=LAYERS, n_heads=8, n_kv_heads=4, ffn_dim=3 * DIM)
    return TrainSpec(
        model=model,
        steps=steps,
        global_batch=BATCH,
        seq_len=SEQ_LEN,
        microbatch_size=BATCH,
        microbatches=1,
        compile=compile_on,
    )


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """In a process of its own (``--case``): build a world-size-1 trainer, train ``steps`` steps,
    per generation; between generations what a surviving rank does (trainer closed, compiled
    graphs forgotten, process group rebuilt). Returns per generation each step's time and what
    it compiled and loaded."""
    import torch
    import torch.distributed as dist

    from elastic.spec import MeshSpec
    from workers import parallelize as par
    from workers.compile import forget_compiled_graphs, use_job_caches
    from workers.data import SyntheticSource
    from workers.runtime import init_generation
    from workers.trainer import Trainer

    torch.set_num_threads(case["threads"])
    compile_on = case["compile"]
    if compile_on:
        use_job_caches(case["cache_dir"], "local")
    loaded_blobs = 0
    if case.get("load_artifacts"):
        torch.compiler.load_cache_artifacts(Path(case["load_artifacts"]).read_bytes())
        loaded_blobs = 1
    spec = case_spec(compile_on=compile_on, steps=case["steps"])
    store = dist.HashStore()
    generations = []
    for generation in range(case["generations"]):
        if dist.is_initialized():
            dist.destroy_process_group()
        mesh = MeshSpec()
        init_generation(
            store=store,
            generation=generation,
            rank=0,
            world_size=1,
            backend="gloo",
            timeout_s=60,
            layout=mesh if compile_on else None,
        )
        par.forget_old_meshes()
        source = SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=0)
        trainer = Trainer(spec, mesh, 0, device=torch.device("cpu"), source=source)
        trainer.init_weights()
        steps = []
        for step in range(1, spec.steps + 1):
            result = trainer.train_step(step)
            counts = result.compiled
            steps.append(
                {
                    "step_time_s": result.step_time_s,
                    "loss": result.loss,
                    "grad_norm": result.grad_norm,
                    "compiled": None if counts is None else counts.compiled,
                    "cache_hits": None if counts is None else counts.cache_hits,
                }
            )
        if generation == 0 and case.get("save_artifacts"):
            saved = torch.compiler.save_cache_artifacts()
            if saved is not None:
                Path(case["save_artifacts"]).write_bytes(saved[0])
        trainer.close()
        source.close()
        if compile_on:
            forget_compiled_graphs(mesh)
        generations.append(steps)
    dist.destroy_process_group()
    return {"generations": generations, "loaded_blobs": loaded_blobs}


def spawn_case(case: dict[str, Any]) -> dict[str, Any]:
    """Driver: run one case in a new process (nothing compiled in this one can help it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.run(
        [sys.executable, BENCH, "--case", json.dumps(case)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=CASE_TIMEOUT_S,
        env=env,
    )
    if process.returncode != 0:
        sys.stderr.write(process.stdout[-4000:] + process.stderr[-4000:])
        raise RuntimeError(f"{BENCH} case {case} failed with exit code {process.returncode}")
    return json.loads(process.stdout.strip().splitlines()[-1])


def steady(steps: list[dict[str, Any]]) -> float:
    """Median step time after the warm-up steps."""
    return statistics.median(s["step_time_s"] for s in steps[WARMUP_STEPS:])


def first_step(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A trainer's first step on its layout against its steady steps."""
    first, later = steps[0]["step_time_s"], steady(steps)
    return {
        "first_step_s": first,
        "steady_step_s": later,
        "ratio": ratio(first, later),
        "compiled": steps[0]["compiled"],
        "cache_hits": steps[0]["cache_hits"],
        "compiled_later": sum(s["compiled"] or 0 for s in steps[1:]),
    }


def local_parts(workdir: Path, *, steps: int, threads: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Parts 1 and 2: three compiled processes (cold and warm in one, joiner) and an eager one."""
    artifacts = workdir / "artifacts.bin"
    base = {"steps": steps, "threads": threads}
    print(f"step: eager, {steps} steps", flush=True)
    eager = spawn_case({**base, "compile": False, "generations": 1})
    print(f"step: compiled, cold cache, then a new generation of the same layout ({steps} steps each)", flush=True)
    compiled = spawn_case(
        {
            **base,
            "compile": True,
            "generations": 2,
            "cache_dir": str(workdir / "cache-cold"),
            "save_artifacts": str(artifacts),
        }
    )
    print("new_mesh: a new process, empty cache, the artifacts loaded first", flush=True)
    joiner = spawn_case(
        {
            **base,
            "compile": True,
            "generations": 1,
            "cache_dir": str(workdir / "cache-joiner"),
            "load_artifacts": str(artifacts) if artifacts.exists() else None,
        }
    )
    eager_steps, [cold, warm], [joined] = eager["generations"][0], compiled["generations"], joiner["generations"]
    step_figures = {
        "compiled_s": steady(cold),
        "eager_s": steady(eager_steps),
        "ratio": ratio(steady(cold), steady(eager_steps)),
        "model": {"dim": DIM, "layers": LAYERS, "seq_len": SEQ_LEN, "batch": BATCH},
        "loss_gap": max(abs(a["loss"] - b["loss"]) for a, b in zip(cold, eager_steps)),
    }
    new_mesh = {
        "cold": first_step(cold),
        "warm": first_step(warm),
        "joiner": {**first_step(joined), "artifact_bytes": artifacts.stat().st_size if artifacts.exists() else 0},
        "eager": first_step(eager_steps),
    }
    return step_figures, new_mesh


# ------------------------------------------------------------------ parts 3-4: the Ray cluster
def compile_overrides(workdir: Path) -> tuple[str, ...]:
    """Compile on, each simulated node with a cache directory of its own."""
    return ("parallelism.tp=1", "training.compile=true", f"runtime.compile_cache_dir={workdir}/{{node_id}}")


def compile_on_new_mesh(events: list[dict[str, Any]], *, after_event: str, new_mesh_event: str) -> Any:
    """The ``compile`` field of the first step on the new mesh (bench/recovery.py's reading of
    where the mesh changed); None when the ranks neither compiled nor loaded a graph in it."""
    from bench.support.recovery_timing import mesh_change

    change = mesh_change(events, after_event=after_event, new_mesh_event=new_mesh_event, began_at=0.0)
    marker = next(i for i, e in enumerate(events) if e["event"] == after_event)
    first = next(e for e in events[marker:] if e["event"] == "step" and e["step"] == change.first_step)
    return first.get("compile")


def kill_part(cluster, workdir: Path, *, steps: int, repeats: int) -> dict[str, Any]:
    """Driver: ``repeats`` kill runs with compile off and as many with it on, alternately (off, on,
    on, off, ...: the order balanced, since a run right after another starts on a busier
    machine); each setting's medians, and what the ranks compiled in each on run."""
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for number in range(repeats):
        for name in ("off", "on") if number % 2 == 0 else ("on", "off"):
            overrides = compile_overrides(workdir / f"kill-cache-{number}") if name == "on" else ("parallelism.tp=1",)
            print(f"kill: compile {name} ({number + 1}/{repeats})", flush=True)
            runs[name].append(kill_run(cluster, workdir / f"kill-{name}-{number}", steps=steps, overrides=overrides))
    on, off = medians(runs["on"]), medians(runs["off"])
    return {"on": on, "off": off, "ratio": ratio(on["fault_to_step_s"], off["fault_to_step_s"]), "goal": KILL_GOAL}


def kill_run(cluster, run_dir: Path, *, steps: int, overrides: tuple[str, ...]) -> dict[str, Any]:
    """One bench/recovery.py kill run, with the ``compile`` fields of its first step and of the
    first step on the new mesh."""
    from bench import recovery
    from orchestrator.observe.events import read_events

    figures = recovery.meshpilot_kill(cluster, run_dir, steps=steps, overrides=overrides)
    events = read_events(run_dir / "events.jsonl")
    first = next((e for e in events if e["event"] == "step"), {})
    return {
        "fault_to_step_s": figures["fault_to_step_s"],
        "lost_steps": figures["lost_steps"],
        "first_step_s": figures["first_step_s"],
        "steady_step_s": figures["steady_step_s"],
        "new_mesh": figures["new_mesh"],
        "compile_first_step": first.get("compile"),
        "compile_on_new_mesh": compile_on_new_mesh(events, after_event="failure", new_mesh_event="recovered"),
    }


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One setting's kill runs: the median of each time, the most steps any run lost, and each
    run's compile counts on the new mesh."""
    times = ("fault_to_step_s", "first_step_s", "steady_step_s")
    return {
        **{key: statistics.median(run[key] for run in runs) for key in times},
        "lost_steps": max(run["lost_steps"] for run in runs),
        "runs": len(runs),
        "fault_to_step_each_s": [round(run["fault_to_step_s"], 3) for run in runs],
        "compile_first_step": [run["compile_first_step"] for run in runs],
        "compile_on_new_mesh": [run["compile_on_new_mesh"] for run in runs],
        "new_mesh": runs[0]["new_mesh"],
    }


def grow_part(cluster, workdir: Path, *, steps: int) -> dict[str, Any]:
    """Driver: bench/recovery.py's node removed then a node added, compile off then on; with the
    ``compile`` field of the first grown step (the new node's ranks load the published artifacts)."""
    from bench import recovery
    from orchestrator.observe.events import read_events

    runs: dict[str, dict[str, Any]] = {}
    for name, overrides in (("off", ("parallelism.tp=1",)), ("on", compile_overrides(workdir / "grow-cache"))):
        print(f"grow: compile {name}", flush=True)
        run_dir = workdir / f"grow-{name}"
        _, grow = recovery.meshpilot_node_then_grow(cluster, run_dir, steps=steps, overrides=overrides)
        events = read_events(run_dir / "events.jsonl")
        grown = grow.get("node_to_step_s") is not None
        counts = compile_on_new_mesh(events, after_event="recovered", new_mesh_event="grow") if grown else None
        runs[name] = {**grow, "compile_on_new_mesh": counts}
    return {
        "on": runs["on"],
        "off": runs["off"],
        "ratio": ratio(runs["on"].get("node_to_step_s"), runs["off"].get("node_to_step_s")),
    }


# ------------------------------------------------------------------ summary
def ratio(ours: float | None, reference: float | None) -> float | None:
    return None if not ours or not reference else round(ours / reference, 3)


def summarize(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The result line's ratios, each beside its goal where the issue sets one."""
    kill = parts.get("kill") or {}
    new_mesh = parts.get("new_mesh") or {}
    return {
        "step_compiled_over_eager": (parts.get("step") or {}).get("ratio"),
        "first_step_over_steady": {case: figures.get("ratio") for case, figures in new_mesh.items()},
        "compiled_on_seen_layout": (new_mesh.get("warm") or {}).get("compiled"),
        "compiled_by_joiner": (new_mesh.get("joiner") or {}).get("compiled"),
        "kill_on_over_off": kill.get("ratio"),
        "kill_goal_met": None if kill.get("ratio") is None else kill["ratio"] <= KILL_GOAL,
        "kill_compile_on_new_mesh": (kill.get("on") or {}).get("compile_on_new_mesh"),
        "kill_lost_steps": {name: (kill.get(name) or {}).get("lost_steps") for name in ("on", "off")},
        "grow_on_over_off": (parts.get("grow") or {}).get("ratio"),
        "grow_compile_on_new_mesh": ((parts.get("grow") or {}).get("on") or {}).get("compile_on_new_mesh"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and kill runs")
    parser.add_argument("--keep", default=None, help="keep the caches, artifacts and runs here")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one process of parts 1-2
    args = parser.parse_args()
    if args.case is not None:
        print(json.dumps(run_case(json.loads(args.case))), flush=True)
        return 0
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="compile-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    parts: dict[str, dict[str, Any]] = {}
    try:
        parts["step"], parts["new_mesh"] = local_parts(workdir, steps=6 if args.quick else 12, threads=2)
        from bench import recovery

        cluster = recovery.start_cluster()
        try:
            parts["kill"] = kill_part(cluster, workdir, steps=12 if args.quick else 16, repeats=2 if args.quick else 3)
            parts["grow"] = grow_part(cluster, workdir, steps=40)
        finally:
            import ray

            ray.shutdown()
            cluster.shutdown()
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(parts, indent=1), flush=True)
    emit(
        {
            "benchmark": "compile",
            "quick": args.quick,
            "wall_s": round(time.time() - started, 1),
            **parts,
            "summary": summarize(parts),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
