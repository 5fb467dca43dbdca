"""One rank's share of training: its stages, optimizer and pipeline schedule, and the step.

Runs on every rank, in the rank actor's loop thread (or in a plain torchrun script: the
benchmark's reference uses this same class). Construction is collective (every rank of the
current process group builds its Trainer at the same time); so is ``train_step``.

A step is: take this data-parallel slice of the step's samples, count the trained labels of the
whole global batch (the loss's denominator), run forward/backward over
``microbatches x accumulation`` microbatches (through the pipeline schedule when pp > 1),
compute the global gradient norm and clip, wait until the device has run all of that, ask the
committer whether the step may be applied (the one place where a failure elsewhere can veto
it, so that every survivor of a failure is left at the same step), then apply the optimizer
step with the scheduled learning rate.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from elastic.spec import MeshSpec, cp_method_on_mesh
from workers import parallelize as par
from workers.compile import CompileWatch, compile_blocks
from workers.data import IGNORE_INDEX, Batch, SampleSource, local_batch, local_samples
from workers.device import PeerWait, PeerWaitMarker, RankDevice
from workers.float8 import apply_float8, precompute_float8_scales
from workers.initial_values import init_weights
from workers.local_updates import LocalAdamW, clip_to_norm, grad_norm
from workers.lora import attach_adapters
from workers.models import StageModel, resolve_family
from workers.pipeline_schedules import build_schedule
from workers.spec import FailureKind, StepDecision, TrainSpec, Verdict
from workers.spec.messages import CompileCounts
from workers.trainer_state import TrainerState

log = logging.getLogger("meshpilot")


class StepAborted(RuntimeError):
    """The step was vetoed (a failure elsewhere); nothing of it was applied."""

    failure_kind = FailureKind.PEER_FAILURE  # the driver vetoed it because another rank failed

    def __init__(self, step: int) -> None:
        super().__init__(f"step {step} aborted before its optimizer update")
        self.step = step


class Committer(Protocol):
    def vote(self, step: int) -> StepDecision:
        """Blocks until every rank is ready to apply ``step``; returns what every rank does with it."""


class StateCopies(Protocol):
    def wait_before_update(self) -> None:
        """Blocks until nothing copies the training state in the background any more (the
        optimizer step is about to change it)."""


class NoStateCopies:
    """The null copies: nothing reads the state in the background (snapshots off, torchrun, tests)."""

    def wait_before_update(self) -> None:
        return None


NO_STATE_COPIES = NoStateCopies()


class AlwaysCommit:
    """The null committer: a run with no controller (torchrun reference, unit tests)."""

    def vote(self, step: int) -> StepDecision:
        return StepDecision(Verdict.COMMIT)


@dataclass
class StepResult:
    step: int
    # This data-parallel slice's share of the step's loss, scaled so that the mean over the slices
    # is the global batch's loss (see Trainer.microbatch_loss); None where this rank does not report it.
    loss: float | None
    grad_norm: float
    lr: float
    step_time_s: float
    # What the commit vote decided beyond applying the step: pause after it (saving first), snapshot it.
    decision: StepDecision = StepDecision(Verdict.COMMIT)
    phases: dict[str, float] = field(default_factory=dict)
    # Global sample indices this rank's data-parallel slice consumed.
    samples: range = range(0)
    expert_load: dict[str, float] = field(default_factory=dict)  # see StageModel.expert_load
    # Labels of the whole global batch that trained (the loss is the mean over them).
    trained_tokens: int = 0
    # training.compile: what this rank's inductor compiled and loaded from the caches in the step.
    compiled: CompileCounts | None = None


class Trainer(TrainerState):
    """Stages, optimizer and schedule of one rank for one mesh. Collective to construct."""

    def __init__(
        self,
        spec: TrainSpec,
        mesh: MeshSpec,
        rank: int,
        *,
        device: torch.device | RankDevice,
        source: SampleSource,
        committer: Committer | None = None,
        peer_waits: PeerWaitMarker | None = None,
        after_compute: Callable[[float, Callable[[], None]], None] | None = None,
    ) -> None:
        """``after_compute(began, sync)`` runs after each step's forward and backward, inside the
        compute phase that began at ``began`` (``time.perf_counter``); ``sync`` waits for the device
        (an injected slowdown sleeps there: ``FaultInjector.after_compute``)."""
        self.spec = spec
        self.after_compute = after_compute
        self.mesh = mesh
        self.rank = rank
        # rank_device syncs and empties the device; device is the torch device tensors go to.
        self.rank_device = RankDevice.of(device)
        self.device = self.rank_device.torch_device
        self.source = source
        self.committer = committer or AlwaysCommit()
        # Marks where the step waits for its peers (read by the actor's hang blame).
        self.peer_waits = peer_waits or PeerWaitMarker()
        self.coords = mesh.coords(rank)
        self.dp_rank = mesh.dp_rank(rank)
        self.family = resolve_family(spec.model.family)
        self.world_mesh = par.build_world_mesh(mesh, self.device.type)
        # With cp > 1 this rank holds two of 2 x cp chunks of every sequence (see context_parallel).
        cp_method = cp_method_on_mesh(
            spec.cp_method, n_heads=spec.model.n_heads, n_kv_heads=spec.model.n_kv_heads, tp=mesh.tp, cp=mesh.cp
        )
        if cp_method is not spec.cp_method and rank == 0:
            log.warning(
                "cp_method %s cannot split the heads over cp=%d: this mesh runs %s", spec.cp_method, mesh.cp, cp_method
            )
        self.sequence_shard = par.sequence_shard(self.world_mesh, mesh, self.coords.cp, cp_method)
        self.ep, self.expert_meshes = self._expert_parallel()
        self.whole_weight_mesh = self._whole_weight_mesh()
        self.plans = par.stage_plans(
            spec.model,
            pp=mesh.pp,
            pp_rank=self.coords.pp,
            stages_per_rank=spec.stages_per_rank,
            schedule=spec.pp_schedule,
        )
        self.modules = [self._build_module(plan) for plan in self.plans]
        # Every thread that runs these modules (autograd's device thread too) drops DTensor
        # caches that still hold an earlier generation's meshes before its first op.
        cache_generation = par.new_cache_generation()
        for module in self.modules:
            par.register_fresh_cache_hooks(module, cache_generation)
            # Auxiliary losses are a mean per microbatch: averaged over the step's microbatches.
            module.scale_auxiliary_losses(1 / (spec.microbatches * self.accumulation))
        self.holds_last_stage = self.plans[-1].last
        self.holds_first_stage = self.plans[0].first
        # Tp rank 0 of each cp rank of the last stage holds the loss of its tokens; the loss is
        # reported once per data-parallel slice, by cp rank 0 (averaged over the cp group first).
        self.holds_loss = self.holds_last_stage and self.coords.tp == 0
        self.reports_loss = self.holds_loss and self.coords.cp == 0
        self.optimizer = self._build_optimizer()
        # What microbatch_loss multiplies its summed token losses by; set per step (and to 1 by
        # the evaluation, which wants the plain sum).
        self.loss_scale = 1.0
        self.schedule = self._build_schedule() if mesh.pp > 1 else None
        # Each stage's parameters as the optimizer holds them (sharded), for after_optimizer_step.
        self._stage_parameters = [dict(module.named_parameters()) for module in self.modules]
        self.compile_watch = CompileWatch() if spec.compile else None

    # ------------------------------------------------------------------ building
    def _expert_parallel(self) -> tuple[int, par.ExpertMeshes | None]:
        """This mesh's expert-parallel degree and meshes (collective when ep > 1). A restore onto
        fewer ranks may leave a dp_shard the configured ep does not divide (``TrainSpec.ep_on``)."""
        ep = self.spec.ep_on(self.mesh.dp_shard)
        if ep != self.spec.ep and self.rank == 0:
            log.info(
                "parallelism.ep=%d does not divide dp_shard=%d: experts split %d ways",
                self.spec.ep,
                self.mesh.dp_shard,
                ep,
            )
        return ep, par.expert_meshes(self.world_mesh, self.mesh, ep) if ep > 1 else None

    def _whole_weight_mesh(self) -> DeviceMesh | None:
        """Collective when it builds one: a family whose layers tp leaves partly whole (a mixture of
        experts' block) runs each rank's tokens through those weights, sharded by FSDP over data x
        tensor ranks (every rank decides alike, from the spec)."""
        if self.mesh.tp > 1 and self.spec.model.tp_whole_params_per_layer:
            return par.whole_weight_mesh(self.world_mesh, self.mesh)
        return None

    def _build_module(self, plan: par.StagePlan) -> StageModel:
        module = par.build_stage_module(self.family, self.spec.model, plan)
        tp_mesh = self.world_mesh["tp"] if self.mesh.tp > 1 else None
        if tp_mesh is not None:
            par.apply_tensor_parallel(module, self.family, self.spec.model, tp_mesh)
        if self.spec.lora is not None:
            # After tensor parallelism (whose styles would split the adapters as their layer), before
            # FSDP2 (which shards them with their block); the base is frozen from here on.
            tp_plan = self.family.tensor_parallel_plan(self.spec.model) if tp_mesh is not None else None
            attach_adapters(module, self.spec.lora, tp_mesh=tp_mesh, tp_plan=tp_plan)
        if self.sequence_shard.split:
            par.apply_context_parallel(module, self.sequence_shard)
        if self.expert_meshes is not None:
            par.apply_expert_parallel(module, self.expert_meshes.ep)
        apply_float8(module, enabled=self.spec.float8, device=self.device)
        if self.spec.compile:
            compile_blocks(module)
        if self.spec.activation_checkpointing:
            par.apply_activation_checkpointing(module)
        param_dtype = torch.bfloat16 if self.spec.dtype == "bfloat16" else torch.float32
        pipelined = self.mesh.pp > 1
        # Gradients summed over the tp ranks (other tokens of the same samples) are divided by this.
        data_parallel = self.mesh.dp * self.mesh.cp
        if self.expert_meshes is not None:
            par.apply_expert_fsdp(
                module, self.expert_meshes, data_parallel=data_parallel, param_dtype=param_dtype, pipelined=pipelined
            )
        if self.whole_weight_mesh is not None:
            par.apply_whole_weight_fsdp(
                module,
                self.whole_weight_mesh,
                data_parallel=data_parallel,
                param_dtype=param_dtype,
                pipelined=pipelined,
            )
        par.apply_fsdp(
            module,
            par.data_parallel_mesh(self.world_mesh, self.mesh),
            param_dtype=param_dtype,
            pipelined=pipelined,
            reshard=self.spec.reshard_after_forward,
            cpu_offload=self.spec.cpu_offload,
        )
        # Offloaded shards live in host memory; FSDP2 moves each to the device when it gathers.
        par.materialize(module, torch.device("cpu") if self.spec.cpu_offload else self.device)
        return module

    def _build_optimizer(self) -> LocalAdamW:
        """AdamW over every trained parameter of this rank's stages (with LoRA, the adapters only:
        a frozen base has no optimizer state), fused (one kernel per device and dtype; torch's
        default is one parameter at a time on CPU) and run on the local shards (see
        ``local_updates``): the same path on CPU and GPU.
        """
        return LocalAdamW(
            [p for module in self.modules for p in module.parameters() if p.requires_grad],
            lr=self.spec.lr,
            betas=(self.spec.beta1, self.spec.beta2),
            weight_decay=self.spec.weight_decay,
        )

    def _build_schedule(self):
        group = self.world_mesh["pp"].get_group()
        return build_schedule(self.spec, self.modules, self.plans, self.device, group, self.microbatch_loss)

    def init_weights(self, *, adapters_only: bool = False) -> None:
        """Fresh start: the same initial model as a single process with the same seed
        (``adapters_only``: the LoRA adapters alone, beside a base loaded from released weights)."""
        for module in self.modules:
            init_weights(module, self.family, self.spec.model, seed=self.spec.seed, adapters_only=adapters_only)

    # ---------------------------------------------------------------------- step
    @property
    def accumulation(self) -> int:
        return self.spec.batch.accumulation(self.mesh.dp)

    def microbatch_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The microbatch's summed token cross entropy over its trained labels (``IGNORE_INDEX``
        elsewhere), in float32, times ``loss_scale``, as a plain scalar tensor.

        In a step ``loss_scale`` is ``dp x cp / N``, N the trained labels of the whole global batch
        (``begin_loss``): FSDP averages gradients over the dp x cp ranks, so the gradients it
        leaves are those of (sum of every trained token's loss) / N: the same on any mesh and any
        accumulation, however the trained tokens fall between microbatches (a mean of microbatch
        means would weigh a microbatch with few trained tokens as much as a full one).

        With tp > 1 the logits are sharded over the vocabulary (a DTensor, see
        ``apply_tensor_parallel``): each rank upcasts only its shard, and ``loss_parallel``
        (entered by ``vocab_parallel_loss`` around forward and backward) reduces the softmax's max
        and sum over the TP group instead of gathering the logits. The replicated result is
        returned as this rank's local scalar, so the schedule and the step see plain tensors.
        """
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
        )
        if isinstance(loss, DTensor):
            loss = loss.to_local()
        return loss * self.loss_scale

    def begin_loss(self, batch: Batch) -> int:
        """Every rank, before a step's first forward: N, the trained labels of the global batch,
        and ``loss_scale = dp x cp / N``. Collective over the data-parallel dimensions when the
        source cannot say N without counting (a loss mask, packing by documents): each rank
        counts its slice's labels (whole samples: every cp, tp and pp rank of a slice holds the
        same), summed over the slices."""
        if self.source.every_label_trains:
            trained = self.spec.global_batch * self.spec.seq_len
        else:
            count = torch.count_nonzero(batch.labels != IGNORE_INDEX).reshape(1)
            # .item() is a device sync point: once per step, before the first forward; a peer that
            # never joins the all-reduce leaves this rank waiting on it (the hang blame says so).
            with self.peer_waits.waiting(PeerWait.RESULT_READ):
                for name in ("dp_replicate", "dp_shard"):
                    if getattr(self.mesh, name) > 1:
                        dist.all_reduce(count, group=self.world_mesh[name].get_group())
                trained = int(count.item())
        # A global batch with nothing to train (every label masked) has loss 0 and no gradient.
        self.loss_scale = self.mesh.dp * self.mesh.cp / max(trained, 1)
        return trained

    @contextlib.contextmanager
    def vocab_parallel_loss(self) -> Iterator[None]:
        """Around forward and backward (the whole schedule step with pp > 1): the vocabulary-
        parallel cross entropy for the sharded logits when tp > 1, nothing otherwise.

        The loss's backward runs the same custom ops, so it must be inside too; the toggle is
        process-wide (DTensor's dispatcher), so autograd's device thread sees it as well.
        """
        if self.mesh.tp == 1 or not self.holds_last_stage:
            yield
            return
        with loss_parallel():
            yield

    def train_step(self, step: int, *, copies: StateCopies = NO_STATE_COPIES) -> StepResult:
        """Collective: every rank of the mesh runs the same step.

        The commit vote follows a device sync (``RankDevice.sync``), so every rank votes on
        gradients its device has finished reducing and clipping; a vetoed step raises
        StepAborted after that sync, with nothing of it applied. Between the two, ``copies``
        (the previous step's peer-memory snapshot, ``workers/peer_snapshots.py``) must finish:
        they read the state the optimizer step changes, while forward and backward ran.
        """
        started = time.perf_counter()
        batch = local_batch(
            self.source, step=step, global_batch=self.spec.global_batch, dp_rank=self.dp_rank, dp=self.mesh.dp
        ).to(self.device)
        loaded = time.perf_counter()  # data_s: what reading (or waiting for the prefetch) cost the step
        trained_tokens = self.begin_loss(batch)
        batch = self.rank_part(batch)
        self._begin_step()
        per_round = self.spec.batch.rank_round_samples
        loss_sum = torch.zeros((), device=self.device)
        for index in range(self.accumulation):
            rows = slice(index * per_round, (index + 1) * per_round)
            loss_sum += self._forward_backward(batch.rows(rows), last_round=index == self.accumulation - 1)
        if self.after_compute is not None:
            self.after_compute(loaded, self.rank_device.sync)
        computed = time.perf_counter()
        grad_norm = self._clip_gradients()
        # NCCL only enqueues the reductions and the clip: vote once the device has run them, so
        # a peer dying meanwhile is seen before this rank votes COMMIT on partial gradients.
        with self.peer_waits.waiting(PeerWait.DEVICE_SYNC):
            self.rank_device.sync()
        # The hook before the optimizer step, pipelined or not (the schedule's step ran above):
        # before the vote too, so that a step applied anywhere proves the copies of the step
        # before it done on every rank.
        copies_started = time.perf_counter()
        copies.wait_before_update()
        copies_waited_s = time.perf_counter() - copies_started
        with self.peer_waits.waiting(PeerWait.COMMIT_VOTE):
            decision = self.committer.vote(step)
        voted = time.perf_counter()
        if decision.verdict == Verdict.ABORT:
            raise StepAborted(step)
        lr = self._apply_step(step)
        # .item() is a device sync point: once per step, after the update has been queued.
        with self.peer_waits.waiting(PeerWait.RESULT_READ):
            loss_sum = self._sequence_mean(loss_sum)
            loss = float(loss_sum.item()) if self.reports_loss else None
            grad_norm_value = float(grad_norm)
        finished = time.perf_counter()
        return StepResult(
            step=step,
            loss=loss,
            grad_norm=grad_norm_value,
            lr=lr,
            step_time_s=finished - started,
            decision=decision,
            phases={
                "data_s": loaded - started,
                "compute_s": computed - loaded,
                "sync_s": voted - computed - copies_waited_s,
                "optimizer_s": finished - voted,
                "snapshot_wait_s": copies_waited_s,
            },
            samples=local_samples(
                step=step, global_batch=self.spec.global_batch, dp_rank=self.dp_rank, dp=self.mesh.dp
            ),
            expert_load={key: value for module in self.modules for key, value in module.expert_load().items()},
            trained_tokens=trained_tokens,
            compiled=None if self.compile_watch is None else self.compile_watch.since_last(),
        )

    def rank_part(self, batch: Batch) -> Batch:
        """This rank's part of its slice's samples (no communication): with cp > 1 its chunks of
        every sequence's inputs and labels; the document numbers stay whole (a query's keys lie
        anywhere in the sequence, see ``SequenceShard``)."""
        take = self.sequence_shard.take
        return Batch(inputs=take(batch.inputs), labels=take(batch.labels), documents=batch.documents)

    def _forward_backward(self, batch: Batch, *, last_round: bool = True) -> torch.Tensor:
        """Forward and backward of one accumulation round; ``last_round``: the step's last.

        Without pipelining, only the step's last microbatch reduces gradients across replica
        groups; the schedule does the same for its own microbatches when pp > 1.
        """
        if self.schedule is not None:
            # The driver refuses data.packing=documents with pp > 1: the schedule carries no documents.
            assert batch.documents is None, "a pipeline passes hidden states only, no document numbers"
            losses: list[torch.Tensor] = []
            self.pipeline_pass(batch.inputs, batch.labels, losses, backward=True)
            return torch.stack(losses).sum().detach() if losses else torch.zeros((), device=self.device)
        module = self.modules[0]
        total = torch.zeros((), device=self.device)
        microbatches = batch.chunk(self.spec.microbatches)
        for index, microbatch in enumerate(microbatches):
            self._set_replica_reduction(last_round and index == len(microbatches) - 1)
            with self.vocab_parallel_loss():
                loss = self.microbatch_loss(module(microbatch.inputs, microbatch.documents), microbatch.labels)
                loss.backward()
            total += loss.detach()
        return total

    def pipeline_pass(
        self, inputs: torch.Tensor, labels: torch.Tensor, losses: list[torch.Tensor] | None, *, backward: bool
    ) -> torch.Tensor | None:
        """One pass of the pipeline schedule over a batch (collective over the pp group, pp > 1).

        The first stage feeds ``inputs``; the last computes each microbatch's loss against
        ``labels`` into ``losses`` (the schedule always does, even forward only) and returns the
        merged output; ``backward``: a training pass, else forward only.
        """
        assert self.schedule is not None, "only a pipelined trainer has a schedule"
        run = self.schedule.step if backward else self.schedule.eval
        kwargs = {"target": labels, "losses": losses} if self.holds_last_stage else {}
        with self.vocab_parallel_loss():
            return run(inputs, **kwargs) if self.holds_first_stage else run(**kwargs)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward only: the model's logits [batch, seq, vocab] for ``tokens`` [batch, seq]
        (``documents`` [batch, seq]: packed by documents, see ``workers.data.Sample``).

        Collective: every rank of the mesh calls it with the same tokens (with pp > 1 the batch
        must divide into ``microbatches``, and no documents; with cp > 1 the length into
        ``2 x cp`` chunks). Returns the whole logits, gathered over tensor and context
        parallelism, on the ranks that hold the last stage; None elsewhere.
        """
        tokens = self.sequence_shard.take(tokens.to(self.device))
        if self.schedule is not None:
            if documents is not None:
                raise ValueError("a pipeline passes hidden states only: logits of packed documents need pp=1")
            # The tokens stand in for labels: the schedule computes a loss, which is dropped.
            output = self.pipeline_pass(tokens, tokens, None, backward=False)
        else:
            output = self.modules[0](tokens, None if documents is None else documents.to(self.device))
        self.reshard()  # pipelined stages stay gathered after a forward
        if not self.holds_last_stage or output is None:
            return None
        output = output.full_tensor() if isinstance(output, DTensor) else output
        return self.sequence_shard.gather_sequence(output, dim=1)

    def _sequence_mean(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The slice's loss over whole sequences: the cp ranks' losses summed (each its tokens'
        share), over cp (each was scaled by dp x cp / N): the slice's token losses x dp / N, whose
        mean over the dp slices (the driver's) is the global batch's loss. Collective over the cp
        group on the last stage's ranks when cp > 1; ``loss_sum`` itself otherwise."""
        if not (self.sequence_shard.split and self.holds_last_stage):
            return loss_sum
        summed = loss_sum.clone()
        dist.all_reduce(summed, group=self.sequence_shard.group)
        return summed / self.mesh.cp

    def _set_replica_reduction(self, enabled: bool) -> None:
        """Whether the next backward all-reduces gradients across replica groups (HSDP).

        Skipped on all but the step's last microbatch: FSDP2 keeps the reduce-scattered
        partial sum and all-reduces it once. The reduce-scatter within a replica group still
        runs each time, so gradients stay sharded (skipping it too would hold a whole stage's
        unsharded gradients per rank).
        """
        if self.mesh.dp_replicate == 1:
            return
        for module in self.modules:
            cast(FSDPModule, module).set_requires_all_reduce(enabled)

    def _clip_gradients(self) -> torch.Tensor:
        """Collective: the global gradient norm over every dimension, then clip by it.

        Each replica group reduces its norm on its own communicators; a different summation
        order (NCCL picks its algorithm per communicator) could give replicas clip factors
        that differ in the last bit, and replicas that drift apart. So every replica applies
        replica group 0's norm, broadcast over the replica dimension (one scalar).
        """
        # The trained parameters' gradients (a frozen base has none).
        grads = [p.grad for module in self.modules for p in module.parameters() if p.grad is not None]
        norm = self._replica_group_grad_norm(grads)
        if self.mesh.dp_replicate > 1:
            group = self.world_mesh["dp_replicate"].get_group()
            dist.broadcast(norm, src=dist.get_global_rank(group, 0), group=group)
        if self.spec.grad_clip > 0:
            clip_to_norm(grads, self.spec.grad_clip, norm)
        return norm

    def _replica_group_grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Collective within this replica group: the 2-norm of all gradients, every stage's
        included (a plain tensor on this rank's device)."""
        norm = grad_norm(grads, self.device)
        if self.mesh.pp > 1:
            squared = norm.pow(2)
            dist.all_reduce(squared, group=self.world_mesh["pp"].get_group())
            norm = squared.sqrt()
        return norm.contiguous()

    def _begin_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for module in self.modules:
            module.start_step()

    def _apply_step(self, step: int) -> float:
        """Collective where a model's ``after_optimizer_step`` is: the optimizer step at ``step``'s
        learning rate (returned), then the models' updates that are not gradient steps."""
        lr = self.spec.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        precompute_float8_scales(self.modules, enabled=self.spec.float8)
        if self.spec.lora is not None:
            return lr  # the base, routing biases included, stays as loaded
        for module, parameters in zip(self.modules, self._stage_parameters, strict=True):
            module.after_optimizer_step(parameters, self._sum_over_stage)
        return lr

    def _sum_over_stage(self, tensor: torch.Tensor) -> None:
        """Collective over every rank holding this rank's stages: all-reduce ``tensor`` (a sum)
        over each of the data, cp and tp dimensions in turn."""
        for name in ("dp_replicate", "dp_shard", "cp", "tp"):
            if getattr(self.mesh, name) > 1:
                dist.all_reduce(tensor, group=self.world_mesh[name].get_group())

    def close(self) -> None:
        """Drop every object that holds a process group, so that destroying them frees their sockets."""
        self.schedule = None
        self.modules = []
        # Dropped rather than set to None: a closed trainer is never used again, and the types
        # stay those of a live one; popping keeps a second close() harmless.
        self.__dict__.pop("optimizer", None)
        self.__dict__.pop("world_mesh", None)
        self.__dict__.pop("expert_meshes", None)
        self.__dict__.pop("whole_weight_mesh", None)
        self.__dict__.pop("_stage_parameters", None)
