"""``meshpilot demo``: the whole product in one command, on this machine.

Runs on the driver (``make demo`` calls it). Starts a local S3 server (SeaweedFS, auth on),
trains the 3D-parallel demo job (pp=2 x dp_shard=2 x tp=2, 8 CPU ranks on an embedded Ray
cluster) on a public-domain text while streaming checkpoints to that server, then exports the
final checkpoint as a Hugging Face model, draws the run's timeline, stops the server, and
prints where every result is.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from checkpointing.catalog import list_committed
from checkpointing.local_s3 import LocalS3Server
from checkpointing.storage import open_storage
from orchestrator.analysis.timeline import format_summary, load_events, summarize
from orchestrator.analysis.timeline_plot import render_timeline
from orchestrator.config import load_config
from orchestrator.observe.progress import ProgressView
from orchestrator.observe.redact import register_secret

BUCKET = "meshpilot-demo"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train the 3D-parallel demo with checkpoints on a local S3 server",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--run-dir", default=None, help="default runs/demo-<timestamp>")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="KEY=VALUE",
        help="override a key of configs/tiny-3d.yaml (repeatable)",
    )
    parser.add_argument("--plain", action="store_true", help="plain progress lines instead of a bar")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from orchestrator.driver.cluster import SOURCE_ROOT
    from orchestrator.driver.run import run_training  # Ray and the controller: only when a job runs
    from workers.hf_transfer import export_family  # torch: only once the demo runs

    run_dir = Path(args.run_dir or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    view = ProgressView(force_plain=args.plain)
    console = view.console
    console.print("[bold]meshpilot demo[/]: starting a local S3 server (SeaweedFS, authentication on)")
    server = LocalS3Server(data_dir=run_dir / "s3-data").start()
    try:
        register_secret(server.secret_key)
        # The embedded Ray cluster's ranks inherit these: the standard AWS credential chain.
        os.environ.update(server.env())
        server.create_bucket(BUCKET)
        uri = f"s3://{BUCKET}/tiny-3d"
        config = load_config(
            SOURCE_ROOT / "configs" / "tiny-3d.yaml",
            [
                f"data.path={SOURCE_ROOT / 'data' / 'sample.txt'}",
                f"checkpoint.uri={uri}",
                f"checkpoint.endpoint_url={server.endpoint_url}",
                *args.overrides,
            ],
        )
        result = run_training(config, run_dir, subscribers=[view], console=console, handle_signals=True)
        if result.exit_code != 0:
            console.print(f"[red]the demo run ended with status {result.status}[/]: {result.reason}")
            return result.exit_code
        storage = open_storage(uri, endpoint_url=server.endpoint_url)
        exported, _ = export_family(storage, run_dir / "hf-model")
        steps = list_committed(storage)
    finally:
        server.stop()
    events = load_events(run_dir)
    summary = summarize(events)
    timeline = render_timeline(events, run_dir / "timeline.png", summary=summary)
    losses = [e["loss"] for e in events if e["event"] == "step" and e.get("loss") is not None]
    console.print(format_summary(summary))
    console.print(
        f"\n[bold green]demo finished[/]: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps\n"
        f"  run directory      {run_dir}\n"
        f"  events             {run_dir / 'events.jsonl'}\n"
        f"  per-rank logs      {run_dir / 'logs'}\n"
        f"  timeline picture   {timeline}\n"
        f"  checkpoints        {uri} (steps {', '.join(map(str, steps))}), "
        f"S3 data kept in {run_dir / 's3-data'}\n"
        f"  Hugging Face model {exported}  (transformers.LlamaForCausalLM.from_pretrained)"
    )
    return 0
