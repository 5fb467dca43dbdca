"""``meshpilot train CONFIG``: train a job on an embedded or existing Ray cluster (driver)."""

from __future__ import annotations

import argparse

from orchestrator.config import load_config
from orchestrator.errors import UserError
from orchestrator.observe.progress import ProgressView
from workers.faults import FaultSpec


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a job described by a YAML config",
        description="Train a job; every key of the config can be overridden with --set.",
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--run-dir", default=None, help="where config.yaml and events.jsonl go (default runs/<name>-<timestamp>)"
    )
    parser.add_argument(
        "--address", default=None, help="an existing Ray cluster (default: RAY_ADDRESS, else an embedded local cluster)"
    )
    parser.add_argument("--plain", action="store_true", help="plain progress lines instead of a bar")
    parser.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND@STEP[:RANK]",
        help="inject a fault (repeatable): kill, raise, hang, drain, sigterm, s3_outage or driver, "
        "at the start of STEP on RANK (default 0), e.g. --inject kill@5:1",
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


def parse_faults(texts: list[str]) -> tuple[FaultSpec, ...]:
    faults = []
    for text in texts:
        try:
            fault = FaultSpec.parse(text)
        except ValueError as error:
            raise UserError(str(error)) from None
        if fault.kind == "node":
            raise UserError(
                f"--inject {text!r}: node faults need a multi-node test cluster "
                "(ray.cluster_utils.Cluster); use the pytest fault harness"
            )
        faults.append(fault)
    return tuple(faults)


def handle(args: argparse.Namespace) -> int:
    from orchestrator.driver.run import run_training  # Ray and the controller: only when a job runs

    overrides = list(args.overrides)
    if args.address:
        overrides.append(f"runtime.address={args.address}")
    config = load_config(args.config, overrides)
    faults = parse_faults(args.inject)
    view = ProgressView(force_plain=args.plain)
    result = run_training(
        config, args.run_dir, subscribers=[view], console=view.console, faults=faults, handle_signals=True
    )
    view.console.print(f"run directory: {result.run_dir}", soft_wrap=True)  # a path to copy: never wrapped
    return result.exit_code
