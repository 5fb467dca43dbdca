"""meshpilot's Python API, installed as the ``meshpilot`` package (``import meshpilot``).

    result = meshpilot.train("configs/tiny-3d.yaml", overrides={"training.steps": 20})
    print(result.exit_code, result.losses[20])

The same run as ``meshpilot train`` (the CLI is a layer over ``train``), plus the names a user
needs to bring a model architecture (``ModelFamily``, what it returns, and the args its shape
subclasses: ``ModelSpec``, or ``LlamaArgs`` for a llama-style block). Every name here is
re-exported from the module that defines it, so ``meshpilot.X is orchestrator...X``.

The model-family names come from ``workers.models``, which imports torch; they are loaded on
first use, so that the driver of ``meshpilot train`` (which imports this package) starts
without torch: ~2 s of its start-up on a 2-core machine.
"""

from typing import TYPE_CHECKING, Any

from orchestrator.api.training import build_config, train
from orchestrator.config import JobConfig, load_config
from orchestrator.driver.run import RunResult
from orchestrator.errors import ConfigError, UserError
from workers.spec import LlamaArgs, ModelSpec, MoeArgs
from workers.spec.families import RopeScaling

if TYPE_CHECKING:
    from workers.models import InitRule, ModelFamily, StageModel, TensorParallelPlan, register_family

_FAMILY_NAMES = frozenset({"InitRule", "ModelFamily", "StageModel", "TensorParallelPlan", "register_family"})


def __getattr__(name: str) -> Any:
    if name in _FAMILY_NAMES:
        import workers.models

        return getattr(workers.models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "InitRule",
    "JobConfig",
    "LlamaArgs",
    "ModelFamily",
    "ModelSpec",
    "MoeArgs",
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
