"""What Prometheus metrics cost a training run: step time with metrics on vs off, same run.

    python bench/metrics_overhead.py                       # 2 ranks, 160 steps, embedded Ray (~1 min)
    python bench/metrics_overhead.py --quick               # 24 steps, for a smoke run (noisy)
    python bench/metrics_overhead.py configs/tiny-3d.yaml --steps 40 --block 4

Two measurements, both printed; the last stdout line is one JSON object.

1. Same run, A/B (the figure asked for): one real ``meshpilot`` run in which the exporter is
   switched on and off in alternating blocks of ``--block`` steps. While on, it gets every
   event and is scraped over HTTP every ``--scrape-interval`` seconds (1 s: 15x a default
   Prometheus); while off it gets nothing. Steps are labelled by the state they ran under (the
   event of step s is handled while step s+1 runs), and ``ratio`` = median step time on /
   median step time off. The reference (off) is measured in the same run, interleaved, so
   drift of a shared machine hits both alike; ``paired_ratio`` is the median, over each "on"
   block and the "off" block after it, of their mean step times' ratio (less sensitive to load
   that drifts during the run). On a 2-core machine shared with other work both still move by
   a few percent from noise, hence also:
2. Driver cost, measured directly: microseconds per step event in ``on_event`` and
   milliseconds per scrape (``render``), for this run's world size and for 1,024 ranks, and
   ``driver_cost_ratio`` = (median step time + cost per step) / median step time, the
   overhead if every microsecond of the driver's work were added to the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit  # noqa: E402
from orchestrator.config import config_from_dict, load_config  # noqa: E402
from orchestrator.observe.metrics import MetricsExporter  # noqa: E402

DEFAULT_STEPS = 160
QUICK_STEPS = 24
DEFAULT_JOB: dict[str, Any] = {
    "name": "metrics-overhead",
    "data": {"source": "synthetic"},
    "parallelism": {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1},
    "training": {"warmup_steps": 2},
    "metrics": {"enabled": False},  # the bench switches its own exporter on and off
}


class SwitchedExporter:
    """Forwards events to the exporter, and lets it be scraped, only in "on" blocks of steps."""

    def __init__(self, exporter: MetricsExporter, url: str, *, block: int, scrape_interval_s: float) -> None:
        self.exporter = exporter
        self.url = url
        self.block = block
        self.scrape_interval_s = scrape_interval_s
        self.enabled = self.is_on(1)
        self.scrapes = 0
        self._stop = threading.Event()
        self._scraper = threading.Thread(target=self._scrape_loop, name="bench-scraper", daemon=True)
        self._scraper.start()

    def is_on(self, step: int) -> bool:
        return ((step - 1) // self.block) % 2 == 0

    def on_event(self, event: dict[str, Any]) -> None:
        if event["event"] == "step":
            # Step s+1 is already running while this event is handled: its state decides.
            self.enabled = self.is_on(event["step"] + 1)
            if self.enabled:
                self.exporter.on_event(event)
        elif self.enabled:
            self.exporter.on_event(event)

    def _scrape_loop(self) -> None:
        while not self._stop.wait(self.scrape_interval_s):
            if self.enabled:
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    response.read()
                self.scrapes += 1

    def close(self) -> None:
        self._stop.set()
        self._scraper.join(timeout=10)


def run_ab(config, *, block: int, scrape_interval_s: float) -> dict[str, Any]:
    from orchestrator.driver.run import run_training
    from orchestrator.observe.events import read_events

    # The run's own exporter stays off (metrics.enabled=false): only the switched one below
    # sees events, so "off" blocks really run without metrics.
    assert not config.metrics.enabled
    exporter = MetricsExporter.from_config(config)
    url = exporter.start_server("127.0.0.1", 0)
    switch = SwitchedExporter(exporter, url, block=block, scrape_interval_s=scrape_interval_s)
    try:
        with tempfile.TemporaryDirectory(prefix="meshpilot-bench-") as run_dir:
            # run_training starts an embedded Ray cluster of its own and stops it again.
            result = run_training(config, Path(run_dir), subscribers=[switch])
            if result.exit_code != 0:
                raise SystemExit(f"training failed: {result.reason}")
            steps = [e for e in read_events(Path(run_dir) / "events.jsonl") if e["event"] == "step"]
    finally:
        switch.close()
        exporter.close()
    warm = [e for e in steps if e["step"] > block]  # the first block pays for start-up
    on = [e["step_time_s"] for e in warm if switch.is_on(e["step"])]
    off = [e["step_time_s"] for e in warm if not switch.is_on(e["step"])]
    return {
        "on": on,
        "off": off,
        "scrapes": switch.scrapes,
        "world_size": config.mesh.world_size,
        "steps": len(steps),
        "paired_ratio": paired_ratio(warm, block=block, is_on=switch.is_on),
    }


def paired_ratio(steps: list[dict[str, Any]], *, block: int, is_on) -> float:
    """Median over neighbouring (on, off) block pairs of mean(on) / mean(off).

    A shared machine's load drifts over a run; neighbouring blocks see nearly the same load,
    so comparing each "on" block with the "off" block right after it cancels most drift.
    """
    blocks: dict[int, list[float]] = {}
    for event in steps:
        blocks.setdefault((event["step"] - 1) // block, []).append(event["step_time_s"])
    ratios = [
        statistics.fmean(blocks[index]) / statistics.fmean(blocks[index + 1])
        for index in sorted(blocks)
        if is_on(index * block + 1) and index + 1 in blocks
    ]
    return statistics.median(ratios) if ratios else float("nan")


def driver_cost(config, world_size: int, repeats: int = 2000) -> dict[str, float]:
    """Microseconds per step event and milliseconds per scrape for ``world_size`` ranks."""
    exporter = MetricsExporter.from_config(config)
    exporter.on_event(
        {
            "event": "start",
            "time": time.time(),
            "world_size": world_size,
            "steps": repeats,
            "mesh": config.mesh.as_dict(),
            "name": config.name,
            "config_hash": "x",
        }
    )
    rank_times = {str(rank): 0.5 + rank * 1e-5 for rank in range(world_size)}
    events = [
        {
            "event": "step",
            "time": time.time(),
            "step": step,
            "loss": 2.0,
            "tokens": 2048,
            "step_time_s": 0.5,
            "world_size": world_size,
            "mesh": config.mesh.as_dict(),
            "lr": 1e-4,
            "grad_norm": 1.0,
            "rank_step_time_s": rank_times,
        }
        for step in range(1, repeats + 1)
    ]
    begin = time.perf_counter()
    for event in events:
        exporter.on_event(event)
    per_event_us = (time.perf_counter() - begin) / repeats * 1e6
    begin = time.perf_counter()
    renders = 50
    for _ in range(renders):
        exporter.render()
    per_render_ms = (time.perf_counter() - begin) / renders * 1e3
    return {"event_us": round(per_event_us, 2), "scrape_ms": round(per_render_ms, 3)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=None, help="job YAML (default: 2 ranks, synthetic data)")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"steps in the run (default {DEFAULT_STEPS}, --quick {QUICK_STEPS}; with 40 the "
        "medians of a shared 2-core machine move by ~5%%)",
    )
    parser.add_argument("--quick", action="store_true", help=f"a short run of {QUICK_STEPS} steps (noisy)")
    parser.add_argument("--block", type=int, default=2, help="steps per on/off block")
    parser.add_argument("--scrape-interval", type=float, default=1.0, dest="scrape_interval_s")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else DEFAULT_STEPS
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.config:
        config = load_config(args.config, [f"training.steps={args.steps}", "metrics.enabled=false"])
    else:
        config = config_from_dict({**DEFAULT_JOB, "training": {**DEFAULT_JOB["training"], "steps": args.steps}})

    ab = run_ab(config, block=args.block, scrape_interval_s=args.scrape_interval_s)
    on_s, off_s = statistics.median(ab["on"]), statistics.median(ab["off"])
    cost_here = driver_cost(config, ab["world_size"])
    cost_large = driver_cost(config, 1024, repeats=200)
    # Per step: one event, plus a share of a scrape every scrape interval.
    per_step_s = cost_here["event_us"] * 1e-6 + cost_here["scrape_ms"] * 1e-3 * off_s / args.scrape_interval_s
    print(
        f"same run, {ab['steps']} steps on {ab['world_size']} ranks, blocks of {args.block}: "
        f"median step {on_s:.4f} s with metrics, {off_s:.4f} s without ({len(ab['on'])} vs {len(ab['off'])} steps, "
        f"{ab['scrapes']} scrapes); neighbouring blocks on / off: {ab['paired_ratio']:.4f}"
    )
    print(
        f"driver cost: {cost_here['event_us']:.1f} us per step event, {cost_here['scrape_ms']:.2f} ms per scrape "
        f"({ab['world_size']} ranks); {cost_large['event_us']:.0f} us and {cost_large['scrape_ms']:.1f} ms "
        "for 1024 ranks"
    )
    emit(
        {
            "benchmark": "metrics_overhead",
            "quick": args.quick,
            "measured": "one real run, exporter switched on/off in alternating step blocks, scraped over HTTP while on",
            "world_size": ab["world_size"],
            "steps": ab["steps"],
            "step_time_on_s": round(on_s, 5),
            "step_time_off_s": round(off_s, 5),
            "ratio": round(on_s / off_s, 4),
            "paired_ratio": round(ab["paired_ratio"], 4),
            "goal": 1.02,
            "scrape_interval_s": args.scrape_interval_s,
            "event_cost_us": cost_here["event_us"],
            "scrape_cost_ms": cost_here["scrape_ms"],
            "event_cost_us_1024_ranks": cost_large["event_us"],
            "scrape_cost_ms_1024_ranks": cost_large["scrape_ms"],
            "driver_cost_ratio": round((off_s + per_step_s) / off_s, 6),
        }
    )


if __name__ == "__main__":
    main()
