"""Plain values both sides import: the model's shape, what a rank trains, and the messages
between the driver and the ranks. No torch and no Ray here (the planner and the driver's
config validation import it on a laptop).

    model.py     ModelSpec: what every family's args hold and answer (counts, parallelism, validation)
    families/    the shipped families' args (LlamaArgs, MoeArgs) and their Hugging Face config.json
    presets.py   the named shapes (model.preset)
    train.py     TrainSpec (the job as a rank sees it), OptimizerSpec, BatchPlan (from elastic.spec),
                 CheckpointTarget, the commit vote's outcomes
    messages.py  everything that crosses the Ray boundary: enums and frozen dataclasses
"""

from workers.spec.families import LlamaArgs, MoeArgs
from workers.spec.messages import (
    CheckpointUploadReport,
    DrainNoticeReport,
    EvalReport,
    FailureKind,
    Heartbeat,
    LogReport,
    Phase,
    PretrainedLoadReport,
    RankReport,
    ReportKind,
    RunOutcome,
    RunStatus,
    StartFrom,
    StartMode,
    StepReport,
    failure_kind_of,
)
from workers.spec.model import ModelSpec
from workers.spec.presets import PRESETS, model_spec
from workers.spec.train import CheckpointTarget, EvalSpec, PretrainedSource, StepDecision, TrainSpec, Verdict

__all__ = [
    "PRESETS",
    "PretrainedSource",
    "StepDecision",
    "Verdict",
    "CheckpointTarget",
    "CheckpointUploadReport",
    "EvalSpec",
    "DrainNoticeReport",
    "EvalReport",
    "FailureKind",
    "Heartbeat",
    "LlamaArgs",
    "LogReport",
    "ModelSpec",
    "MoeArgs",
    "Phase",
    "RankReport",
    "ReportKind",
    "RunOutcome",
    "RunStatus",
    "StartFrom",
    "StartMode",
    "PretrainedLoadReport",
    "StepReport",
    "TrainSpec",
    "failure_kind_of",
    "model_spec",
]
