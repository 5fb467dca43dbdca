"""How often the driver's abort leaves a gloo rank stuck in a collective: ours against the old flow.

    python bench/release.py            # 30 trials of each flow (~10 min on 2 cores)
    python bench/release.py --quick    # 6 trials of each, for a smoke run

One trial: two real processes join a gloo world with two sub-groups and run reduce-scatters
and all-reduces back to back; after 1 s plus a random 0-30 ms offset each releases itself as a
rank does on the driver's abort, while its loop is in or between collectives. A rank whose loop
has not left ``STUCK_AFTER_S`` later is stuck (it would wait for the collective timeout).

- ours: ``release_collectives`` (sockets shut for reading first, groups not aborted while the
  loop runs);
- reference: what the driver's abort did before: every socket shut both ways at once, then
  the groups aborted (``abort_groups``).

The trials of the two flows alternate, so the machine's load hits both alike. This is a worst
case: a collective is always in flight when the release comes. The last stdout line is one
JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import random
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit  # noqa: E402

FLOWS = ("ours", "reference")
STUCK_AFTER_S = 6.0
DEFAULT_TRIALS = 30
QUICK_TRIALS = 6


def _rank(rank: int, port: int, flow: str, delay_s: float, results: Any) -> None:
    """One rank of a trial: put True on ``results`` if its loop is stuck after the release."""
    import torch
    import torch.distributed as dist

    from workers.group_abort import abort_groups, release_collectives
    from workers.sockets import GroupSockets, shutdown_open

    watch = GroupSockets("gloo")
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    scatter, reduce = dist.new_group([0, 1]), dist.new_group([0, 1])
    sockets = watch.opened()
    left = threading.Event()

    def loop() -> None:
        data, out = torch.ones(4096), torch.empty(2048)
        try:
            while True:
                dist.reduce_scatter_single(out, data, group=scatter)
                dist.all_reduce(data, group=reduce, async_op=True).wait()
        except RuntimeError:
            left.set()

    threading.Thread(target=loop, daemon=True).start()
    time.sleep(1.0 + (delay_s if rank == 0 else 0.0))
    if flow == "ours":
        release_collectives(sockets, "gloo")
    else:
        shutdown_open(sockets, socket.SHUT_RDWR)
        abort_groups(set())
    results.put(not left.wait(STUCK_AFTER_S))


def trial(flow: str, delay_s: float) -> int:
    """Ranks stuck (0-2) in one two-process trial of ``flow``."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)  # a free port
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(rank, store.port, flow, delay_s, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    try:
        return sum(bool(results.get(timeout=120)) for _ in ranks)
    finally:
        for process in ranks:  # a stuck rank's loop never ends: its process is ended here
            process.kill()
            process.join(10)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_TRIALS} trials of each flow")
    parser.add_argument("--trials", type=int, default=None, help=f"trials of each flow (default {DEFAULT_TRIALS})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the release offsets")
    args = parser.parse_args(argv)
    if args.trials is None:
        args.trials = QUICK_TRIALS if args.quick else DEFAULT_TRIALS
    if args.trials < 1:
        parser.error(f"--trials must be at least 1, not {args.trials}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    offsets = random.Random(args.seed)
    stuck = dict.fromkeys(FLOWS, 0)
    for number in range(args.trials):
        delay_s = offsets.choice([0.0, 0.001, 0.003, 0.01, 0.03])
        for flow in FLOWS:
            stuck[flow] += trial(flow, delay_s)
        print(f"trial {number + 1}/{args.trials}: stuck so far {stuck}", flush=True)
    ranks = 2 * args.trials
    emit(
        {
            "benchmark": "release",
            "quick": args.quick,
            "ranks_per_flow": ranks,
            "stuck_ranks": stuck,
            "stuck_fraction": {flow: round(count / ranks, 3) for flow, count in stuck.items()},
            "ratio_ours_vs_reference": round(stuck["ours"] / stuck["reference"], 3) if stuck["reference"] else None,
        }
    )


if __name__ == "__main__":
    main()
