"""meshpilot's Python API, installed as the ``meshpilot`` package (``import meshpilot``).

    result = meshpilot.train("configs/tiny-3d.yaml", overrides={"training.steps": 20})
    print(result.exit_code, result.losses[20])

The same run as ``meshpilot train`` (the CLI is a layer over ``train``), plus the names a user
needs to bring a model architecture (``ModelFamily`` and what it returns). Every name here is
re-exported from the module that defines it, so ``meshpilot.X is orchestrator...X``.
"""

from orchestrator.api.training import build_config, train
from orchestrator.config import JobConfig, load_config
from orchestrator.driver.run import RunResult
from orchestrator.errors import ConfigError, UserError
from workers.models import InitRule, ModelFamily, StageModel, TensorParallelPlan, register_family
from workers.spec import ModelSpec
from workers.spec.model import RopeScaling

__all__ = [
    "ConfigError",
    "InitRule",
    "JobConfig",
    "ModelFamily",
    "ModelSpec",
    "RopeScaling",
    "RunResult",
    "StageModel",
    "TensorParallelPlan",
    "UserError",
    "build_config",
    "load_config",
    "register_family",
    "train",
]
