"""``meshpilot train CONFIG``: train a job on an embedded or existing Ray cluster (driver).

A layer over ``meshpilot.train`` (``orchestrator/api``): arguments in, the run directory out.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from orchestrator.api.training import train


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a job described by a YAML config",
        description="Train a job; every key of the config can be overridden with --set.",
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--run-dir",
        default=None,
        help="where config.yaml, events.jsonl and logs go: a directory, or s3://BUCKET/PREFIX to mirror "
        "runs/<name>-<timestamp> to as the run goes (default: runtime.run_dir, else runs/<name>-<timestamp>)",
    )
    parser.add_argument(
        "--resume-run",
        default=None,
        metavar="RUN_DIR",
        help="go on with the run recorded in RUN_DIR (same config; its events continue there): with "
        "runtime.survive_driver_loss its live ranks are adopted, else it resumes from its checkpoint",
    )
    parser.add_argument(
        "--address", default=None, help="an existing Ray cluster (default: RAY_ADDRESS, else an embedded local cluster)"
    )
    parser.add_argument("--plain", action="store_true", help="plain progress lines instead of a bar")
    parser.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND@STEP[:RANK][/PHASE]",
        help="inject a fault (repeatable): kill, raise, hang, drain, sigterm, s3_outage or driver, "
        "at the start of STEP on RANK (default 0), e.g. --inject kill@5:1; with /configure (kill, raise) "
        "while a mesh resuming at STEP configures, e.g. after another fault; /join (kill) as that mesh's "
        "process groups are built; /snapshot (kill) while STEP's peer-memory snapshot is copied",
    )
    parser.add_argument(
        "--chaos",
        default=None,
        metavar="SEED[:N]",
        help="inject N faults (default 6) drawn reproducibly from SEED over the run: kill, raise, hang, "
        "sigterm, s3_outage (with checkpoints), some during the recovery of another; the schedule is "
        "printed and recorded as the fault_schedule event, so a seed replays exactly",
    )
    parser.set_defaults(handler=handle)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None, help="job YAML (omit for the built-in defaults)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set parallelism.tp=4 (repeatable)",
    )


def handle(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.address:
        overrides.append(f"runtime.address={args.address}")
    result = train(
        args.config,
        overrides=overrides,
        run_dir=args.run_dir,
        inject=args.inject,
        chaos=args.chaos,
        progress=True,
        plain_progress=args.plain,
        handle_signals=True,
        resume_run=args.resume_run,
    )
    console = Console()
    console.print(f"run directory: {result.run_dir}", soft_wrap=True)  # a path to copy: never wrapped
    if result.record_uri:
        console.print(f"run record: {result.record_uri}", soft_wrap=True)
    return result.exit_code
