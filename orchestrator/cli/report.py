"""``meshpilot report RUN_DIR [--out PNG]``: print a run's summary and draw its timeline.

Runs wherever the run directory is readable (the driver's machine, a laptop with a copy), or
anywhere that reaches the run's mirrored record:

    meshpilot report runs/tiny-3d-20261122-140312
    meshpilot report s3://bucket/ckpt/nightly/runs/nightly-20261122-140312 --endpoint-url http://127.0.0.1:8333
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from orchestrator.analysis.timeline import format_summary, load_events, summarize
from orchestrator.analysis.timeline_plot import render_timeline


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="timeline picture and summary of a run",
        description="Read RUN_DIR/events.jsonl, print a summary (effective training time, recovery times, "
        "lost steps, checkpoint stall) and draw a PNG timeline. RUN_DIR may be a run record mirrored to "
        "s3://BUCKET/PREFIX (credentials from the AWS chain).",
    )
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", help="the run directory or run record (s3://...) `meshpilot train` printed"
    )
    parser.add_argument(
        "--out",
        metavar="PNG",
        default=None,
        help="where to write the picture (default: RUN_DIR/timeline.png; ./timeline.png for an s3:// record)",
    )
    parser.add_argument(
        "--endpoint-url",
        default=None,
        help="S3 endpoint of a non-AWS server, e.g. http://127.0.0.1:8333 (default: AWS_ENDPOINT_URL_S3 "
        "or AWS_ENDPOINT_URL)",
    )
    parser.add_argument("--region", default=None, help="S3 region (default: the AWS chain's)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    remote = args.run_dir.startswith("s3:")
    # The standard AWS variables, read here at the edge (boto3 reads the rest of the chain itself).
    endpoint_url = args.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    events = load_events(args.run_dir, endpoint_url=endpoint_url, region=args.region)
    summary = summarize(events)
    default_out = Path("timeline.png") if remote else Path(args.run_dir) / "timeline.png"
    out = Path(args.out) if args.out else default_out
    render_timeline(events, out, summary=summary)
    print(format_summary(summary))
    print(f"timeline: {out}")
    return 0
