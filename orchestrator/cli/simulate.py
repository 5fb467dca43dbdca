"""``meshpilot simulate``: goodput of each recovery policy, and the best checkpoint interval.

Runs on the driver or a laptop (the simulator is ``elastic.simulator``, pure). Example, Llama 3's
reported 419 unexpected interruptions in 54 days on 16,384 GPUs:

    meshpilot simulate --gpus 16384 --interruptions 419 --days 54 --plot bench/results/goodput-llama3.png

Recovery and checkpoint times come from, in order: the flag, the measured figure in
bench/results/latest.json (``orchestrator.analysis.bench_figures``), the documented default below. The
output says which for each.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from elastic.simulator import POLICIES, SimulationInputs, SimulationResult, Sweep, default_mttf_hours, sweep
from orchestrator.analysis.bench_figures import DEFAULT_PATH, Figure, load_figures
from orchestrator.errors import UserError

# Defaults where no flag and no measured figure is given: assumptions for a large GPU job, each
# overridable. (figure name in bench/results/latest.json, flag, default, why)
TIMINGS: dict[str, tuple[str, str, float, str]] = {
    "checkpoint_stall_s": (
        "checkpoint_stall_s",
        "--stall-s",
        10.0,
        "async sharded checkpoint: only the copy to host blocks",
    ),
    "checkpoint_upload_s": (
        "checkpoint_upload_s",
        "--upload-s",
        0.0,
        "a checkpoint counts as restorable when its stall ends",
    ),
    "restart_s": (
        "restart_recovery_s",
        "--restart-s",
        300.0,
        "reschedule, re-initialise NCCL and load the checkpoint on every rank",
    ),
    "inplace_recovery_s": (
        "inplace_recovery_s",
        "--inplace-s",
        60.0,
        "detect the failure, rebuild communicators without the failed replica",
    ),
    "drain_s": ("drain_recovery_s", "--drain-s", 30.0, "rebuild communicators without the draining replica"),
    "grow_s": ("grow_s", "--grow-s", 30.0, "new replica joins at a step boundary, shards copied peer to peer"),
}
DEFAULT_REPLICA_GPUS = 128  # one tp 8 x pp 16 copy of Llama 3 405B
DEFAULT_DAYS = 30.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="goodput per recovery policy and the best checkpoint interval",
        description="Discrete-event simulation (seeded, deterministic) of failures, preemption notices, "
        "checkpoints and recoveries; prints the effective-training-time ratio per policy and the "
        "best checkpoint interval next to Young/Daly's.",
    )
    _add_failure_rate_flags(parser)
    _add_timing_flags(parser)
    _add_job_shape_flags(parser)
    parser.add_argument(
        "--policy", action="append", choices=POLICIES, default=None, help="policies to simulate (repeat; default all)"
    )
    parser.add_argument("--trials", type=int, default=5, help="runs averaged per point (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bench-results",
        default=str(DEFAULT_PATH),
        help="measured figures (JSON); 'none' to use only flags and defaults",
    )
    parser.add_argument("--plot", default=None, metavar="OUT.png", help="write goodput vs checkpoint interval")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run_simulate)


def _add_failure_rate_flags(parser: argparse.ArgumentParser) -> None:
    """The job's size, how often it fails (one of three ways to say it), and the simulated span."""
    parser.add_argument("--gpus", type=int, default=16384, help="GPUs in the job (default 16384)")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--mttf-hours", type=float, default=None, help="mean time between failures of the whole job")
    rate.add_argument(
        "--gpu-mttf-hours",
        type=float,
        default=None,
        help="mean time between failures of one GPU (the job's is this / --gpus)",
    )
    rate.add_argument(
        "--interruptions",
        type=int,
        default=None,
        help="failures observed over --days (e.g. Llama 3: 419 in 54 days on 16,384 GPUs)",
    )
    parser.add_argument(
        "--days",
        type=float,
        default=None,
        help=f"simulated wall time, and the window of --interruptions (default {DEFAULT_DAYS:g})",
    )


def _add_timing_flags(parser: argparse.ArgumentParser) -> None:
    """The checkpoint interval and every duration; a ``TIMINGS`` flag left out takes the measured figure or default."""
    parser.add_argument(
        "--checkpoint-interval-min",
        type=float,
        default=None,
        help="also report every policy at this checkpoint interval",
    )
    for field_name, (_, flag, default, why) in TIMINGS.items():
        parser.add_argument(
            flag,
            type=float,
            default=None,
            dest=field_name,
            help=f"seconds; default: measured figure if any, else {default:g} ({why})",
        )
    parser.add_argument(
        "--replace-min",
        type=float,
        default=15.0,
        help="minutes until a replacement node joins a shrunk job (default 15)",
    )
    parser.add_argument("--step-s", type=float, default=10.0, help="seconds per training step (default 10)")


def _add_job_shape_flags(parser: argparse.ArgumentParser) -> None:
    """Replica groups and spot preemption notices: what an in-place recovery can drop and when."""
    parser.add_argument(
        "--replica-gpus",
        type=int,
        default=None,
        help=f"GPUs per replica group, the unit dropped in place (default {DEFAULT_REPLICA_GPUS}, "
        "or all GPUs when fewer)",
    )
    parser.add_argument("--min-replicas", type=int, default=1, help="fewest replica groups to train on")
    parser.add_argument("--preemptions-per-day", type=float, default=0.0, help="spot preemption notices per day")
    parser.add_argument("--notice-s", type=float, default=120.0, help="seconds between a notice and the node leaving")


def run_simulate(args: argparse.Namespace) -> int:
    inputs, sources, failure_source = build_inputs(args)
    if args.trials < 1:
        raise UserError(f"--trials={args.trials} must be >= 1")
    requested = args.checkpoint_interval_min * 60 if args.checkpoint_interval_min is not None else None
    result = sweep(
        inputs,
        policies=tuple(args.policy) if args.policy else POLICIES,
        trials=args.trials,
        seed=args.seed,
        requested_interval_s=requested,
    )
    plot_path = None
    if args.plot:
        from orchestrator.analysis.goodput_plot import render_goodput_plot

        title = (
            f"{inputs.gpus} GPUs, MTTF {inputs.mttf_s / 3600:.2f} h, {inputs.horizon_s / 86400:g} days, "
            f"stall {inputs.checkpoint_stall_s:g} s, restart {inputs.restart_s:g} s, "
            f"in-place {inputs.inplace_recovery_s:g} s"
        )
        plot_path = render_goodput_plot(result, args.plot, title=title)
    if args.json:
        print(json.dumps(simulate_json(result, sources, failure_source, plot_path), indent=2))
    else:
        print(format_simulation(result, sources, failure_source, plot_path))
    return 0


def build_inputs(args: argparse.Namespace) -> tuple[SimulationInputs, dict[str, str], str]:
    """The scenario from flags, measured figures and defaults; with where each time came from."""
    if args.gpus < 1:
        raise UserError(f"--gpus={args.gpus} must be >= 1")
    days = args.days if args.days is not None else DEFAULT_DAYS
    if not days > 0:
        raise UserError(f"--days={days} must be > 0")
    if args.interruptions is not None:
        if args.interruptions < 1:
            raise UserError(f"--interruptions={args.interruptions} must be >= 1")
        if args.days is None:
            raise UserError("--interruptions needs --days: the window they were counted over")
        mttf_h = days * 24 / args.interruptions
        failure_source = f"{args.interruptions} interruptions in {days:g} days"
    elif args.mttf_hours is not None:
        mttf_h, failure_source = args.mttf_hours, "--mttf-hours"
    elif args.gpu_mttf_hours is not None:
        mttf_h = args.gpu_mttf_hours / args.gpus
        failure_source = f"--gpu-mttf-hours={args.gpu_mttf_hours:g} / {args.gpus} GPUs"
    else:
        mttf_h = default_mttf_hours(args.gpus)
        failure_source = "Meta reliability study (7.9 h at 1,024 GPUs, 1.8 h at 16,384), scaled to this size"
    if not mttf_h > 0:
        raise UserError(f"the mean time between failures must be > 0 hours, got {mttf_h:g}")
    replica_gpus = args.replica_gpus if args.replica_gpus is not None else min(DEFAULT_REPLICA_GPUS, args.gpus)
    if replica_gpus < 1 or args.gpus % replica_gpus:
        raise UserError(
            f"--replica-gpus={replica_gpus} must divide --gpus={args.gpus} "
            "(the job is a whole number of replica groups)"
        )
    figures = {} if str(args.bench_results).lower() == "none" else load_figures(Path(args.bench_results))
    timings, sources = {}, {}
    for field_name, (figure_name, flag, default, why) in TIMINGS.items():
        value, source = _timing(getattr(args, field_name), flag, figures.get(figure_name), default, why)
        timings[field_name], sources[field_name] = value, source
    interval_s = args.checkpoint_interval_min * 60 if args.checkpoint_interval_min is not None else 600.0
    inputs = SimulationInputs(
        gpus=args.gpus,
        mttf_s=mttf_h * 3600,
        horizon_s=days * 86400,
        checkpoint_interval_s=interval_s,
        replace_s=args.replace_min * 60,
        replicas=args.gpus // replica_gpus,
        min_replicas=args.min_replicas,
        step_s=args.step_s,
        preemptions_per_day=args.preemptions_per_day,
        notice_s=args.notice_s,
        **timings,
    )
    problems = inputs.problems()
    if problems:
        raise UserError("; ".join(problems))
    return inputs, sources, failure_source


def _timing(flag_value: float | None, flag: str, figure: Figure | None, default: float, why: str) -> tuple[float, str]:
    if flag_value is not None:
        return flag_value, flag
    if figure is not None:
        return figure.value, figure.source()
    return default, f"default: {why}"


# ---------------------------------------------------------------------------- output
def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def format_simulation(result: Sweep, sources: dict[str, str], failure_source: str, plot_path: Path | None) -> str:
    inputs = result.inputs
    replica_gpus = inputs.gpus // inputs.replicas
    lines = [
        f"meshpilot simulate: {inputs.gpus} GPUs in {inputs.replicas} replica group"
        f"{'s' if inputs.replicas > 1 else ''} of {replica_gpus}, {inputs.horizon_s / 86400:g} days, "
        f"{result.trials} trial{'s' if result.trials > 1 else ''} (seed {result.seed})",
        f"failures: MTTF {inputs.mttf_s / 3600:.2f} h ({failure_source})",
        f"preemptions: {inputs.preemptions_per_day:g}/day with {inputs.notice_s:g} s notice"
        if inputs.preemptions_per_day
        else "preemptions: none",
        "times:",
    ]
    for field_name in TIMINGS:
        lines.append(f"  {field_name:<20} {getattr(inputs, field_name):>8.2f} s  [{sources[field_name]}]")
    lines.append(f"  {'replace_s':<20} {inputs.replace_s:>8.2f} s  [--replace-min]")
    lines.append(f"  {'step_s':<20} {inputs.step_s:>8.2f} s  [--step-s]")
    lines.append(
        f"Young/Daly interval: sqrt(2 x {inputs.checkpoint_stall_s:g} s x {inputs.mttf_s / 3600:.2f} h) = "
        f"{_duration(result.young_daly_s)}"
    )
    lines.append("")
    lines.append(
        f"{'policy':<8} {'best interval':>13} {'goodput':>8} {'at Y/D':>7}   at the best interval: "
        f"{'restores':>8} {'lost work':>10} {'paused':>9} {'ckpt stall':>10} {'shrunk':>9}"
    )
    for curve in result.curves:
        best = curve.best
        # At the grid's end the optimum lies beyond it: checkpoints hardly matter to this policy.
        edge = ">= " if best.checkpoint_interval_s == max(curve.intervals_s) else ""
        lines.append(
            f"{curve.policy:<8} {edge + _duration(best.checkpoint_interval_s):>13} {best.goodput:>8.2%} "
            f"{curve.at_young_daly.goodput:>7.2%}   {'':21}{best.restores:>8} {_duration(best.lost_work_s):>10} "
            f"{_duration(best.paused_s):>9} {_duration(best.checkpoint_stall_s):>10} {_duration(best.shrunk_loss_s):>9}"
        )
    requested = [(curve.policy, curve.at_requested) for curve in result.curves if curve.at_requested is not None]
    if requested:
        interval = requested[0][1].checkpoint_interval_s
        lines.append(
            f"at a {_duration(interval)} interval: "
            + ", ".join(f"{policy} {point.goodput:.2%}" for policy, point in requested)
        )
    lines.append(
        "goodput = effective training time / wall time (lost work, pauses, stalls and missing capacity excluded)"
    )
    if plot_path is not None:
        lines.append(f"plot: {plot_path}")
    return "\n".join(lines)


def simulate_json(
    result: Sweep, sources: dict[str, str], failure_source: str, plot_path: Path | None
) -> dict[str, object]:
    inputs = result.inputs

    def short(item: SimulationResult) -> dict[str, object]:
        return {key: round(value, 6) if isinstance(value, float) else value for key, value in item.as_dict().items()}

    return {
        "inputs": {key: getattr(inputs, key) for key in inputs.__dataclass_fields__},
        "sources": {**sources, "mttf_s": failure_source},
        "trials": result.trials,
        "seed": result.seed,
        "young_daly_interval_s": round(result.young_daly_s, 3),
        "policies": {
            curve.policy: {
                "best_interval_s": round(curve.best_interval_s, 3),
                "best_goodput": round(curve.best_goodput, 6),
                "best": short(curve.best),
                "at_young_daly": short(curve.at_young_daly),
                "at_requested": None if curve.at_requested is None else short(curve.at_requested),
                "curve": [[round(r.checkpoint_interval_s, 3), round(r.goodput, 6)] for r in curve.results],
            }
            for curve in result.curves
        },
        "plot": str(plot_path) if plot_path is not None else None,
    }
