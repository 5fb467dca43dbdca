"""One training run on the driver: from a validated config to a terminal state.

    run.py              run_training: run directory, Ray, event log, controller, signals
    controller.py       the state machine, one iteration per ``step()``; states.py holds its states
    polling.py          one poll of the ranks: heartbeats -> detector, reports -> router; the last step
    detector.py         what the driver sees -> which ranks are lost and why
    stragglers.py       per-rank compute times -> stragglers to replace, exclude or report
    mesh_change.py      settling an ending generation, carrying out the policies' decisions in place
    restore.py          restoring onto a mesh from peer memory or a checkpoint; reshaping
    replicas.py         replica books: who stays, who goes warm, who joins, what fits
    worker_group.py     the rank actors: placement groups, slots, fan-out calls
    cluster.py          connecting to Ray (embedded or existing), node liveness, drains
    checkpoint_commits  the driver's half of checkpoints: commit manifests, choose what to resume
    rank_reports.py     rank reports -> the run's events (step, log, checkpoint, drain notice)
    train_spec.py       the job config -> what every rank is sent (TrainSpec)

May import ``orchestrator.observe``, ``orchestrator.config``/``config_checks``/``errors``, ``elastic``,
``workers.spec`` (and ``workers.actor`` for the class handle), ``checkpointing``'s torch-free
modules. Never ``torch``; Ray's private APIs only through its one compat module.
"""
