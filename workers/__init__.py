"""The rank side: one Ray actor per rank, its process groups, model, data and training loop.

    actor.py         RankActor: configure / run / poll / abort, one per rank
    trainer.py       one rank's model, optimizer and step (FSDP2 + TP + PP)
    parallelize.py   TP, FSDP2 and pipeline stages applied to the model
    model.py, data.py, rendezvous.py (store + commit vote), runtime.py (process groups),
    checkpoints.py (the rank's checkpoint writer/reader), reporting.py (the one channel to the
    driver), notices.py (drain notices), faults.py (injected faults), sockets.py,
    ray_compat.py (the rank side's only use of Ray's private APIs)
    spec/            plain values both sides import (model shape, TrainSpec, messages)

May import ``elastic.spec`` and ``checkpointing``; never ``orchestrator``. Heavy imports
(torch) happen inside the actor's process, not when the driver imports the class handle.
"""
