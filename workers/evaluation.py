"""Evaluation while training: the mean loss over the trained tokens of a fixed set of samples,
the same on any mesh.

Runs on every rank, in the rank actor's loop thread at a step boundary after the commit (or in a
test's spawned ranks). ``Evaluator.evaluate`` is collective: every rank of the mesh calls it for
the same boundary, in this order:

    1. every rank: its data-parallel slice's contiguous share of ``eval_sample(0 .. n-1)``,
       ``n = batches x global_batch`` (read from the source once per evaluator, then kept);
    2. every rank: forward only, in the step's rounds and microbatches (through the pipeline
       schedule's ``eval`` when pp > 1; the vocabulary-parallel loss when tp > 1);
    3. every rank: one all-reduce over the world of (sum of token losses, trained-token count), to
       which only the loss-holding ranks of each data-parallel slice contribute (tp rank 0 of the
       last stage, each cp rank for its part of the sequences), so every rank returns the same
       ``EvalResult``. The loss is the sum over every trained token (a label other than
       ``IGNORE_INDEX``) over their count, as in training.

Nothing the training depends on is touched: no gradient is computed, the optimizer and its state
are not read, no random number is drawn, and the data cursor (the step number) does not move.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from elastic.spec import samples_per_rank
from workers.data import IGNORE_INDEX, Batch
from workers.device import PeerWait

if TYPE_CHECKING:
    from workers.trainer import Trainer


@dataclass(frozen=True)
class EvalResult:
    """One evaluation, as every rank holds it after the reduction."""

    loss: float  # mean token cross entropy over the evaluation samples' trained tokens
    tokens: int  # how many trained tokens it is the mean over
    eval_s: float  # this rank's wall time for the evaluation


class Evaluator:
    """The evaluation of one trainer (one rank of one mesh): ``batches x global_batch`` samples."""

    def __init__(self, trainer: Trainer, *, batches: int) -> None:
        self.trainer = trainer
        self.batches = batches
        self._samples: Batch | None = None

    def local_samples(self) -> Batch:
        """This data-parallel slice's evaluation samples, n / dp rows (local, no collective)."""
        if self._samples is None:
            trainer = self.trainer
            per_rank = samples_per_rank(self.batches * trainer.spec.global_batch, trainer.mesh.dp)
            first = trainer.dp_rank * per_rank
            self._samples = Batch.stack([trainer.source.eval_sample(i) for i in range(first, first + per_rank)])
        return self._samples

    @torch.no_grad()
    def evaluate(self) -> EvalResult:
        """Collective over the mesh: the mean token loss over every evaluation sample (see the module)."""
        trainer = self.trainer
        started = time.perf_counter()
        samples = trainer.rank_part(self.local_samples().to(trainer.device))
        per_round = trainer.spec.batch.rank_round_samples
        loss_sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
        for start in range(0, len(samples), per_round):
            loss_sum += round_loss_sum(trainer, samples.rows(slice(start, start + per_round)))
        # Each data-parallel slice counts once: the tp ranks of the last stage hold the same loss;
        # its cp ranks each count their own tokens.
        counted = 1.0 if trainer.holds_loss else 0.0
        trained = torch.count_nonzero(samples.labels != IGNORE_INDEX).to(torch.float64)
        totals = torch.stack([loss_sum, trained]) * counted
        with trainer.peer_waits.waiting(PeerWait.RESULT_READ):
            dist.all_reduce(totals)
            loss_total, token_total = totals.tolist()  # a device sync point
        loss = loss_total / token_total if token_total else 0.0
        return EvalResult(loss=loss, tokens=int(token_total), eval_s=time.perf_counter() - started)


def round_loss_sum(trainer: Trainer, samples: Batch) -> torch.Tensor:
    """Collective, forward only: the summed token cross entropy over the trained labels of one round
    of this rank's part of its slice's samples (``Trainer.rank_part``; microbatches x
    microbatch_size rows, the step's round), as a float64 scalar on the ranks holding the last
    stage; zero elsewhere.

    The round goes through the same microbatches as a step (the pipeline's stages were set up for
    that shape), with ``Trainer.microbatch_loss`` left unscaled (a plain sum); the step's scale is
    put back after.
    """
    step_scale, trainer.loss_scale = trainer.loss_scale, 1.0
    try:
        if trainer.schedule is not None:
            losses: list[torch.Tensor] = []
            trainer.pipeline_pass(samples.inputs, samples.labels, losses, backward=False)
        else:
            module = trainer.modules[0]
            with trainer.vocab_parallel_loss():
                losses = [
                    trainer.microbatch_loss(module(microbatch.inputs, microbatch.documents), microbatch.labels)
                    for microbatch in samples.chunk(trainer.spec.microbatches)
                ]
    finally:
        trainer.loss_scale = step_scale
    trainer.reshard()  # pipelined stages stay gathered after a forward
    if not losses:
        return torch.zeros((), dtype=torch.float64, device=trainer.device)
    return torch.stack(losses).double().sum()
