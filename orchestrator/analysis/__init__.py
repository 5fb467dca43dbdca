"""Offline reading of what runs and benchmarks left behind (no Ray, no torch).

    timeline.py       ``meshpilot report``: a run's summary and its timeline PNG from events.jsonl
    goodput_plot.py   ``meshpilot simulate``'s goodput-vs-checkpoint-interval PNG
    bench_figures.py  measured figures the benchmarks record for the simulator (bench/results)

May import ``orchestrator.observe`` (reading events), ``orchestrator.errors`` and ``elastic``.
"""
