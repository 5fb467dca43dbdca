"""Offline reading of what runs and benchmarks left behind (no Ray, no torch).

    timeline.py       ``meshpilot report``: a run's summary from events.jsonl
    timeline_plot.py  ``meshpilot report``: the run's timeline PNG
    goodput_plot.py   ``meshpilot simulate``'s goodput-vs-checkpoint-interval PNG
    bench_figures.py  measured figures the benchmarks record for the simulator (bench/results)

May import ``orchestrator.observe`` (reading events), ``orchestrator.errors`` and ``elastic``.
"""
