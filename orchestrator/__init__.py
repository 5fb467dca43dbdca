"""The driver side of meshpilot: everything that runs in the user's process (or a Ray job's
entrypoint), never on a rank. No ``torch.distributed`` here.

    cli/         one module per ``meshpilot`` subcommand: argparse and printing, nothing else
    driver/      one training run: Ray connection, rank actors, the controller's state machine,
                 failure detection, checkpoint commits, the rank-report router
    observe/     what a run tells the world: events.jsonl, Prometheus metrics, logs, progress, redaction
    analysis/    offline reading of finished runs and benchmark figures (timeline, goodput plot)
    submission/  the Ray Job SDK client behind ``meshpilot submit`` / ``meshpilot jobs``
    config.py    the job config (YAML -> validated dataclasses); errors.py: user errors (exit 2)

Imports go one way: ``cli -> driver | submission | analysis -> observe -> config, errors``;
any of them may import ``elastic`` (pure decisions), ``workers.spec`` (plain values) and
``checkpointing``'s torch-free driver side. The driver takes the rank actor's class handle
from ``workers.actor`` and its message types from ``workers.spec``, nothing else of ``workers``.
"""
