"""``meshpilot report RUN_DIR [--out PNG]``: print a run's summary and draw its timeline.

Runs wherever the run directory is readable (the driver's machine, a laptop with a copy).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.analysis.timeline import format_summary, load_events, summarize
from orchestrator.analysis.timeline_plot import render_timeline


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="timeline picture and summary of a run",
        description="Read RUN_DIR/events.jsonl, print a summary (effective training time, recovery times, "
        "lost steps, checkpoint stall) and draw a PNG timeline.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory `meshpilot train` printed")
    parser.add_argument(
        "--out", metavar="PNG", default=None, help="where to write the picture (default: RUN_DIR/timeline.png)"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    events = load_events(args.run_dir)
    summary = summarize(events)
    out = Path(args.out) if args.out else Path(args.run_dir) / "timeline.png"
    render_timeline(events, out, summary=summary)
    print(format_summary(summary))
    print(f"timeline: {out}")
    return 0
