"""The parts of ``bench/gpu_check.py``, each run in a process of its own (``--part NAME``).

A part gets the output directory, whether it is a smoke run and its deadline in seconds. It
plans within the deadline (a measurement that no longer fits is recorded as skipped), writes what
it has measured so far to ``DIR/parts/NAME.json`` after each measurement (the parent reads it if
it has to kill the part) and prints its record, one JSON object, as its last stdout line. Later
parts read earlier parts' figures from ``DIR/gpu_check.json`` (the measured matmul ceiling, the
step times the snapshot cadence needs).
"""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import emit, run_process_group

GIB = 2**30
RESULT_FILE = "gpu_check.json"
OPTIONAL_PACKAGES = ("torchao", "torchtitan", "ray", "boto3")
WHEELS_HELPER = "python bench/support/gpu_wheels.py"


@dataclass
class PartContext:
    """What a part knows: where to write, how long it has, and what earlier parts measured."""

    out: Path
    name: str
    smoke: bool
    deadline_s: float
    started: float = field(default_factory=time.monotonic)
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return torch.cuda.is_available()

    def left_s(self) -> float:
        return self.deadline_s - (time.monotonic() - self.started)

    def earlier(self) -> dict[str, Any]:
        """The parts recorded so far (``DIR/gpu_check.json``, written by the parent)."""
        try:
            return dict(json.loads((self.out / RESULT_FILE).read_text()).get("parts", {}))
        except (OSError, ValueError):
            return {}

    def save(self, **figures: Any) -> None:
        """Add figures to this part's record and write it where the parent finds it if killed."""
        self.record.update(figures)
        folder = self.out / "parts"
        folder.mkdir(parents=True, exist_ok=True)
        temporary = folder / f".{self.name}.json.tmp"
        temporary.write_text(json.dumps(self.record))
        os.replace(temporary, folder / f"{self.name}.json")


def run_part(name: str, *, out: Path, smoke: bool, deadline_s: float, started: float) -> None:
    """Entry of a part's process: run it and print its record as the last stdout line.
    ``started``: when the process started (``time.monotonic()``), where its deadline counts from."""
    context = PartContext(out=out, name=name, smoke=smoke, deadline_s=deadline_s, started=started)
    context.save(status="running")
    PARTS[name](context)
    if context.record.get("status") == "running":
        context.record["status"] = "measured"
    context.save()
    emit(context.record)


def skipped(context: PartContext, reason: str, **figures: Any) -> None:
    context.save(status="skipped", reason=reason, **figures)


# --------------------------------------------------------------------- environment
def environment(context: PartContext) -> None:
    """Versions, the device, and the ceilings every later figure is read against."""
    import transformers

    context.save(
        python=platform.python_version(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        transformers=transformers.__version__,
        packages={name: package_state(name) for name in OPTIONAL_PACKAGES},
        cpu_count=os.cpu_count(),
        host_memory_gib=host_memory_gib(),
        torch_compat=private_symbols(),
    )
    if not context.cuda:
        context.save(device="cpu", matmul=cpu_matmul(), device_to_host="skipped: no CUDA device")
        return
    properties = torch.cuda.get_device_properties(0)
    context.save(
        device=properties.name,
        capability=f"{properties.major}.{properties.minor}",
        device_memory_gib=round(properties.total_memory / GIB, 1),
        matmul=cuda_matmul(),
    )
    context.save(device_to_host=device_to_host())


def package_state(name: str) -> str:
    """A package's version, or why it cannot be imported (without importing it)."""
    try:
        if importlib.util.find_spec(name) is None:
            return "not installed"
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "importable (no metadata)"
    except ImportError as error:
        return f"not importable: {error}"


def private_symbols() -> str:
    """Whether every private torch symbol of the fence resolves on this torch (its one line if not)."""
    try:
        from checkpointing import torch_compat
    except ImportError as error:  # TorchVersionError names each missing symbol
        return str(error)
    return f"all {len(torch_compat.PRIVATE_SYMBOLS)} private symbols resolve"


def host_memory_gib() -> float | None:
    """MemAvailable of /proc/meminfo (Linux), in GiB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return round(int(line.split()[1]) * 1024 / GIB, 1)
    except OSError:
        pass
    return None


def cpu_matmul(size: int = 256, repeats: int = 5) -> dict[str, Any]:
    """float32 square matmuls on the CPU, timed with the wall clock (a smoke of the arithmetic)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    began = time.perf_counter()
    for _ in range(repeats):
        a @ b
    seconds = (time.perf_counter() - began) / repeats
    return {"dtype": "float32", "size": size, "timer": "perf_counter", "tflops": round(2 * size**3 / seconds / 1e12, 4)}


def cuda_matmul(sizes: tuple[int, ...] = (4096, 8192, 16384), repeats: int = 20) -> dict[str, Any]:
    """bf16 square matmuls on the GPU, timed with CUDA events; the ceiling is the best size's rate."""
    per_size = {}
    for size in sizes:
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):  # cuBLAS picks its kernel and warms its workspace
            a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            a @ b
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / repeats
        per_size[str(size)] = round(2 * size**3 / seconds / 1e12, 1)
        del a, b
    torch.cuda.empty_cache()
    return {"dtype": "bfloat16", "timer": "cuda events", "tflops_by_size": per_size, "tflops": max(per_size.values())}


def device_to_host(nbytes: int = GIB, repeats: int = 5) -> dict[str, Any]:
    """Copies of ``nbytes`` from the GPU into pinned and into pageable host memory (best of ``repeats``)."""
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    rates = {}
    for kind, pinned in (("pinned", True), ("pageable", False)):
        target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            began = time.perf_counter()
            target.copy_(source, non_blocking=pinned)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - began)
        rates[f"{kind}_gb_per_s"] = round(nbytes / best / 1e9, 1)
        del target
    return {"bytes": nbytes, **rates}


# --------------------------------------------------------------------- throughput
@dataclass(frozen=True)
class Shape:
    """A model shape the throughput part trains, and its batch."""

    label: str
    preset: str
    n_layers: int | None
    seq_len: int
    batch: int
    note: str = ""


def shapes(smoke: bool) -> list[Shape]:
    if smoke:
        return [Shape("debug", "debug", None, seq_len=64, batch=4, note="smoke: the debug preset on the CPU")]
    return [
        Shape("llama3-1b", "llama3-1b", None, seq_len=2048, batch=4),
        Shape(
            "llama3-8b-16l",
            "llama3-8b",
            16,
            seq_len=2048,
            batch=4,
            note=(
                "llama3-8b's layer shapes with 16 of its 32 layers (4.5B parameters): the whole model does not fit "
                "one 141 GB GPU at this batch (16 bytes a parameter for its state, 128 GB, plus activations and "
                "logits: the planner estimates 180 GB; 102 GB for 16 layers), and FSDP2's CPU offload would time "
                "the host's optimizer, not the GPU; tokens/s is of this model, MFU counts its own FLOPs"
            ),
        ),
    ]


# Most valuable first: the eager comparison of both shapes, then compiled, then compiled + float8.
MODES = ("eager", "compiled", "compiled_float8")
SIDES = ("ours", "reference")
# A run is not started with less than this left (process start, model build, a few steps).
RUN_MIN_S = {"eager": 25.0, "compiled": 60.0, "compiled_float8": 60.0}
SMOKE_RUN_MIN_S = 5.0
RUN_CAP_S = 150.0


def throughput(context: PartContext) -> None:
    """meshpilot's Trainer against the reference, every shape and mode, one process per run."""
    steps, warmup = (4, 1) if context.smoke else (10, 3)
    datasheet, ceiling = peaks(context)
    context.save(
        steps=steps,
        warmup_steps=warmup,
        peak_tflops_datasheet=datasheet and datasheet / 1e12,
        peak_tflops_measured=ceiling and ceiling / 1e12,
        reference=reference_kind(),
        runs={},
    )
    runs: dict[str, Any] = context.record["runs"]
    for mode in MODES:
        for shape in shapes(context.smoke):
            for side in SIDES:
                key = f"{shape.label}/{mode}/{side}"
                runs[key] = measure_run(context, shape, mode, side, steps=steps, warmup=warmup)
                runs[key].update(mfu_figures(runs[key], datasheet, ceiling))
                context.save(runs=runs, comparisons=comparisons(runs))
    context.save(shapes={shape.label: shape.note for shape in shapes(context.smoke) if shape.note})
    if not any(run.get("status") == "measured" for run in runs.values()):
        skipped(context, "no run measured: " + "; ".join(sorted({str(run.get("reason")) for run in runs.values()})))


def measure_run(context: PartContext, shape: Shape, mode: str, side: str, *, steps: int, warmup: int) -> dict:
    """One run in its own process (a compile that crashes, or memory held by a finished run,
    stays there); skipped when it cannot fit or this machine cannot run the mode."""
    if not context.smoke and not context.cuda:
        return {"status": "skipped", "reason": "the full sizes need a CUDA device; --smoke trains tiny ones on the CPU"}
    if context.smoke and mode != "eager":
        return {
            "status": "skipped",
            "reason": "--smoke trains eager only: inductor's first compile alone takes longer than the smoke's budget",
        }
    if mode == "compiled_float8" and not context.cuda:
        return {"status": "skipped", "reason": "float8 training needs a CUDA device of compute capability 8.9+"}
    if mode == "compiled_float8" and importlib.util.find_spec("torchao") is None:
        return {"status": "skipped", "reason": f"torchao is not installed (fetch its wheel: {WHEELS_HELPER})"}
    if side == "ours" and mode != "eager":
        missing = missing_feature(mode)
        if missing:
            return {"status": "skipped", "reason": missing}
    left, least = context.left_s(), SMOKE_RUN_MIN_S if context.smoke else RUN_MIN_S[mode]
    if left < least:
        return {"status": "skipped", "reason": f"{left:.0f} s left in the part; a {mode} run needs {least:g} s"}
    argv = [sys.executable, "-m", "bench.support.gpu_check_run", "--side", side, "--preset", shape.preset]
    argv += ["--mode", mode, "--seq-len", str(shape.seq_len), "--batch", str(shape.batch)]
    argv += ["--steps", str(steps), "--warmup", str(warmup)]
    argv += ["--n-layers", str(shape.n_layers)] if shape.n_layers else []
    return run_json(argv, timeout_s=min(RUN_CAP_S, left - 2))


def missing_feature(mode: str) -> str | None:
    """Why this tree cannot run ``mode`` on our side, if it cannot (the setting would be a no-op)."""
    needed = {"compiled": ["workers.compile"], "compiled_float8": ["workers.compile", "workers.float8"]}[mode]
    absent = [name for name in needed if importlib.util.find_spec(name) is None]
    if absent:
        return f"{', '.join(absent)} not in this tree: training.compile/float8 would change nothing"
    return None


def run_json(argv: list[str], *, timeout_s: float) -> dict[str, Any]:
    """Run a command to completion; its last stdout line as a record, or why there is none."""
    returncode, stdout, stderr = run_process_group(argv, timeout=timeout_s)
    if returncode is None:
        return {"status": "timed_out", "reason": f"ran past {timeout_s:.0f} s"}
    lines = stdout.strip().splitlines()
    if returncode == 0 and lines:
        try:
            return dict(json.loads(lines[-1]))
        except ValueError:
            pass
    text = (stdout + stderr).strip().splitlines()
    return {"status": "failed", "reason": f"exit code {returncode}", "log_tail": "\n".join(text[-15:])}


def peaks(context: PartContext) -> tuple[float | None, float | None]:
    """(datasheet, measured) peak FLOP/s of the device: the known device's bf16 dense peak, and
    the environment part's matmul ceiling when it ran on this device."""
    from orchestrator.observe.metric_names import peak_flops

    if not context.cuda:
        return None, None
    datasheet = peak_flops(None, torch.cuda.get_device_name(0))
    matmul = context.earlier().get("environment", {}).get("matmul", {})
    measured = matmul.get("tflops") if matmul.get("dtype") == "bfloat16" else None
    return datasheet, measured and measured * 1e12


def mfu_figures(run: dict[str, Any], datasheet: float | None, ceiling: float | None) -> dict[str, Any]:
    if run.get("status") != "measured":
        return {}
    achieved = run["tokens_per_s"] * run["flops_per_token"]
    return {
        "mfu_datasheet": datasheet and round(achieved / datasheet, 4),
        "mfu_measured_ceiling": ceiling and round(achieved / ceiling, 4),
    }


def comparisons(runs: dict[str, Any]) -> dict[str, Any]:
    """Our tokens/s over the reference's per shape and mode; each side's step time against its eager one."""
    ratios: dict[str, Any] = {}
    for key, run in runs.items():
        shape, mode, side = key.split("/")
        if run.get("status") != "measured":
            continue
        if side == "ours":
            other = runs.get(f"{shape}/{mode}/reference", {})
            if other.get("status") == "measured":
                ratios[f"{shape}/{mode}/ours_over_reference_tokens_per_s"] = round(
                    run["tokens_per_s"] / other["tokens_per_s"], 3
                )
        eager = runs.get(f"{shape}/eager/{side}", {})
        if mode != "eager" and eager.get("status") == "measured":
            ratios[f"{shape}/{mode}/{side}_step_over_eager"] = round(run["step_s"] / eager["step_s"], 3)
    return ratios


def reference_kind() -> dict[str, str]:
    """What the reference is, and why it is not TorchTitan itself when it is not."""
    why = torchtitan_problem()
    return {
        "kind": "transformers LlamaForCausalLM + FSDP2 with TorchTitan's recipe (bench/support/gpu_check_run.py)",
        "why_not_torchtitan": why
        or "torchtitan imports here, but only the transformers reference is driven by this check so far",
    }


def torchtitan_problem() -> str | None:
    """Why TorchTitan's Llama 3 cannot run here, or None when it imports."""
    if importlib.util.find_spec("torchtitan") is None:
        return f"torchtitan is not installed (fetch its wheel: {WHEELS_HELPER})"
    try:
        importlib.import_module("torchtitan.models.llama3")
    except Exception as error:  # noqa: BLE001 - whatever the import raises is the answer, not a crash
        return f"torchtitan.models.llama3 does not import on torch {torch.__version__}: {type(error).__name__}: {error}"
    return None


# --------------------------------------------------------------------- memory
def memory(context: PartContext) -> None:
    """Peak device memory of our eager runs against the planner's estimate for their layout."""
    from bench.support.gpu_check_run import job_config
    from elastic.cost_model import Cluster, Layout, Workload, estimate
    from elastic.hardware import GPU_KINDS

    throughput_runs = context.earlier().get("throughput", {}).get("runs", {})
    figures = {}
    for shape in shapes(context.smoke):
        config = job_config(
            shape.preset,
            n_layers=shape.n_layers,
            seq_len=shape.seq_len,
            batch=shape.batch,
            steps=3,
            mode="eager",
            cuda=context.cuda,
        )
        workload = Workload(model=config.model_spec, seq_len=shape.seq_len, global_batch=shape.batch)
        layout = Layout(mesh=config.mesh, microbatches=config.parallelism.microbatches)
        predicted = estimate(workload, Cluster(gpus=1, gpus_per_node=1, gpu=GPU_KINDS["h200"]), layout).memory
        entry: dict[str, Any] = {"estimate": predicted.as_dict()}
        if context.cuda:
            run = throughput_runs.get(f"{shape.label}/eager/ours", {})
            if run.get("status") != "measured":
                run = measure_run(context, shape, "eager", "ours", steps=3, warmup=1)
            if run.get("status") == "measured" and run.get("peak_memory_bytes"):
                entry.update(
                    measured_peak_gb=round(run["peak_memory_bytes"] / 1e9, 3),
                    measured_reserved_gb=round(run["peak_reserved_bytes"] / 1e9, 3),
                    measured_over_estimate=round(run["peak_memory_bytes"] / predicted.total, 3),
                )
            else:
                entry.update(measured="none", reason=run.get("reason", "no eager run of ours finished"))
        figures[shape.label] = entry
        context.save(shapes=figures)
    if not context.cuda:
        skipped(context, "peak device memory needs a CUDA device (the estimates above are the planner's)")


# --------------------------------------------------------------------- checkpoint
# What a snapshot or a staged checkpoint copies per parameter: float32 parameters and AdamW's two moments.
STATE_BYTES_PER_PARAM = 12


def checkpoint(context: PartContext) -> None:
    """Chunked pinned staging (``HostBuffer``) of a 1.5B and an 8B model's state: the first save
    (which allocates and page-locks the buffer), the stall of later saves, and the snapshot interval
    the adaptive cadence picks from that stall and the measured step time."""
    from bench.support.gpu_check_run import DEMO_CONFIG
    from orchestrator.config import load_config
    from workers.spec import PRESETS

    limit = load_config(DEMO_CONFIG).elastic.snapshot_overhead_limit
    steps = step_times(context)
    figures = {}
    seconds_per_gb = 0.0  # what staging the previous size took, for whether the next one fits
    for label, preset in (("1.5B", "llama3-1b"), ("8B", "llama3-8b")):
        params = PRESETS[preset].num_params
        wanted = params * STATE_BYTES_PER_PARAM
        needed = 10 + seconds_per_gb * staged_bytes(wanted, smoke=context.smoke) / 1e9
        if context.left_s() < needed:
            figures[label] = {
                "status": "skipped",
                "reason": f"{context.left_s():.0f} s left in the part; this size needs about {needed:.0f} s",
            }
            continue
        began = time.monotonic()
        staged = stage_state(wanted, smoke=context.smoke)
        seconds_per_gb = (time.monotonic() - began) / staged["measured_gb"]
        gc.collect()  # the device tensors and the host buffer of this size go before the next
        if context.cuda:
            torch.cuda.empty_cache()
        entry: dict[str, Any] = {"state_gb": round(wanted / 1e9, 2), **staged}
        step_s = steps.get(preset)
        if step_s:
            cost_steps = staged["stall_s_at_full_size"] / step_s["step_s"]
            from elastic.snapshot_cadence import SnapshotCadence

            entry.update(
                step_s=step_s["step_s"],
                step_source=step_s["source"],
                snapshot_cost_steps=round(cost_steps, 3),
                overhead_limit=limit,
                cadence_interval_steps=SnapshotCadence(1, overhead_limit=limit).interval_for(cost_steps),
            )
        figures[label] = entry
        context.save(states=figures)
    if all(state.get("status") == "skipped" for state in figures.values()):
        skipped(context, "no state staged: " + "; ".join(sorted({state["reason"] for state in figures.values()})))


def step_times(context: PartContext) -> dict[str, dict[str, Any]]:
    """Our measured eager step time per preset; a shortened model's scaled by its FLOPs."""
    from workers.spec import PRESETS

    runs = context.earlier().get("throughput", {}).get("runs", {})
    found = {}
    for shape in shapes(context.smoke):
        run = runs.get(f"{shape.label}/eager/ours", {})
        if run.get("status") != "measured":
            continue
        whole = PRESETS[shape.preset].flops_per_token(shape.seq_len)
        scale = whole / run["flops_per_token"]
        source = f"{shape.label} eager (ours)" + (f" x {scale:.2f} (FLOPs of the whole model)" if scale != 1 else "")
        found[shape.preset] = {"step_s": round(run["step_s"] * scale, 5), "source": source}
    if context.smoke and "debug" in found:  # the smoke's only model stands in for both
        found = {"llama3-1b": found["debug"], "llama3-8b": found["debug"]}
    return found


def staged_bytes(state_bytes: int, *, smoke: bool) -> int:
    """How much of ``state_bytes`` is staged: a few MiB on a smoke run (CPU); on CUDA as much as
    80% of the free device memory and 45% of the available host memory allow."""
    if smoke or not torch.cuda.is_available():
        return min(state_bytes, (16 if state_bytes < 50e9 else 64) * 2**20)
    free, _ = torch.cuda.mem_get_info()
    host = (host_memory_gib() or 0) * GIB
    return int(min(state_bytes, 0.8 * free, 0.45 * host))


def stage_state(state_bytes: int, *, smoke: bool) -> dict[str, Any]:
    """Stage ``state_bytes`` of device tensors into a ``HostBuffer`` a few times. On a smoke run
    (CPU) the state is scaled down to a few MiB and the buffer is pageable; on CUDA it is as
    large as device and host memory allow, the figures scaled linearly to the full size."""
    from checkpointing.staging import HostBuffer, plan_layout

    cuda = torch.cuda.is_available()
    measured = staged_bytes(state_bytes, smoke=smoke)
    tensor_bytes = min(256 * 2**20, measured)  # about one large layer weight each
    device = torch.device("cuda" if cuda and not smoke else "cpu")
    count = max(1, measured // tensor_bytes)
    tensors = {f"state.{index}": torch.ones(tensor_bytes // 4, device=device) for index in range(count)}
    layout = plan_layout(tensors, rank=0, owns_plain_tensors=True)
    began = time.perf_counter()
    buffer = HostBuffer(layout, pin_memory=device.type == "cuda")
    allocated_s = time.perf_counter() - began
    stalls = []
    for _ in range(4):
        began = time.perf_counter()
        buffer.stage(tensors)
        stalls.append(time.perf_counter() - began)
    scale = state_bytes / (count * tensor_bytes)
    stall = statistics.median(stalls[1:])
    return {
        "measured_gb": round(count * tensor_bytes / 1e9, 3),
        "pinned": buffer.pinned,
        "registered_chunks": len(buffer.chunk_starts) if buffer.chunk_starts else (1 if buffer.pinned else 0),
        "allocate_s": round(allocated_s, 4),
        "first_stage_s": round(stalls[0], 4),
        "stall_s": round(stall, 4),
        "copy_gb_per_s": round(count * tensor_bytes / stall / 1e9, 2),
        "first_save_s_at_full_size": round((allocated_s + stalls[0]) * scale, 3),
        "stall_s_at_full_size": round(stall * scale, 4),
    }


# --------------------------------------------------------------------- ray
def ray(context: PartContext) -> None:
    """With Ray: one rank killed and restored on the same GPU, then ``bench/gpu.py --quick``."""
    problem = ray_problem()
    if problem:
        skipped(context, problem)
        return
    if not context.cuda:
        skipped(context, "the recovery test and bench/gpu.py need a CUDA device")
        return
    # The one-GPU case of tests/gpu/test_recovery.py (the others need two GPUs).
    test = "tests/gpu/test_recovery.py::test_the_only_rank_killed_restores_its_checkpoint_on_the_same_gpu"
    pytest = [sys.executable, "-m", "pytest", test, "-x", "-q", "-p", "no:cacheprovider"]
    context.save(recovery=run_text(pytest, timeout_s=min(150, context.left_s() - 60)))
    if context.left_s() < 60:
        context.save(gpu_bench={"status": "skipped", "reason": f"{context.left_s():.0f} s left in the part"})
        return
    presets = ["debug", "llama3-1b"] if context.left_s() > 180 else ["debug"]
    bench = [sys.executable, "bench/gpu.py", "--quick", "--presets", *presets]
    context.save(gpu_bench=run_json(bench, timeout_s=context.left_s() - 2))


def ray_problem() -> str | None:
    try:
        importlib.import_module("ray")
    except Exception as error:  # noqa: BLE001 - whatever the import raises is the answer, not a crash
        return f"ray does not import here ({type(error).__name__}: {error}); fetch its wheels: {WHEELS_HELPER} --ray"
    return None


def run_text(argv: list[str], *, timeout_s: float) -> dict[str, Any]:
    """Run a command; whether it passed, and its last lines."""
    returncode, stdout, stderr = run_process_group(argv, timeout=max(1.0, timeout_s))
    if returncode is None:
        return {"status": "timed_out", "reason": f"ran past {timeout_s:.0f} s"}
    lines = (stdout + stderr).strip().splitlines()
    return {"status": "passed" if returncode == 0 else "failed", "tail": "\n".join(lines[-10:])}


PARTS: dict[str, Callable[[PartContext], None]] = {
    "environment": environment,
    "throughput": throughput,
    "memory": memory,
    "checkpoint": checkpoint,
    "ray": ray,
}
