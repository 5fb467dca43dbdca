"""What a run tells the world, all fed by one event stream (driver side).

    events.py    RUN_DIR/events.jsonl and its subscribers; the event names and their fields
    metrics.py   the Prometheus exporter (every ``meshpilot_`` metric declared there)
    logs.py      console and per-rank JSON-lines logs
    progress.py  the terminal progress bar
    redact.py    credentials kept out of everything written or printed

May import ``orchestrator.config``/``errors``, ``elastic.spec``, ``workers.spec``; never the
driver, the CLI, Ray or torch.
"""
