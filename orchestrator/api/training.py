"""``meshpilot.train``: the same run as ``meshpilot train``, from Python, in this process.

Runs on the driver (the calling process): builds and validates the job config (from a YAML
path, a mapping, a ``JobConfig`` built in code, or the defaults), applies ``--set``-style
overrides and the model family, then trains on the embedded Ray cluster (or the one
``runtime.address`` / ``RAY_ADDRESS`` names) and returns when the run ends. A config that cannot
run raises ``ConfigError`` (a ``UserError``: its message names every key and the fix); a run
that fails returns a ``RunResult`` whose ``exit_code`` is not 0 and whose ``reason`` says why.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.config import JobConfig, config_from_dict, load_config
from orchestrator.driver.run import RunResult
from orchestrator.errors import ConfigError, UserError
from workers.faults import NETWORK_KINDS, FaultSpec

if TYPE_CHECKING:
    from workers.models import ModelFamily  # torch: imported only where a family class is passed

ConfigSource = str | Path | Mapping[str, Any] | JobConfig | None


def train(
    config: ConfigSource = None,
    *,
    overrides: Iterable[str] | Mapping[str, Any] = (),
    model_family: type[ModelFamily] | str | None = None,
    run_dir: str | Path | None = None,
    inject: Iterable[str] = (),
    chaos: str | None = None,
    progress: bool = False,
    plain_progress: bool = False,
    handle_signals: bool = False,
    resume_run: str | Path | None = None,
) -> RunResult:
    """Train a job to its end and return how it ended.

    ``overrides``: ``["parallelism.tp=2", ...]`` or ``{"parallelism.tp": 2}``, as ``--set``.
    ``model_family``: a ``ModelFamily`` subclass (importable by every rank: defined in a module,
    not in ``__main__``) or its ``package.module:Class`` path; sets ``model.family``.
    ``run_dir``: a directory, or ``s3://bucket/prefix`` (mirrored from a local directory; wins
    over ``runtime.run_dir``). ``inject``: faults as ``--inject`` takes them (``"kill@5:1"``).
    ``chaos``: ``"SEED[:N]"``, N faults drawn from SEED on top (``orchestrator/driver/chaos.py``).
    ``progress``: draw the progress bar (``plain_progress``: one line per step). ``handle_signals`` (main thread only):
    SIGTERM checkpoints and stops at the next step boundary, Ctrl-C stops after the step.
    ``resume_run``: the record directory of a run to go on with (its events continue there): the
    config must be the one it was started with (``ConfigError`` names the keys that differ); with
    ``runtime.survive_driver_loss`` its live ranks are adopted, else it resumes from its checkpoint.
    """
    from orchestrator.driver.run import run_training  # Ray and the controller: only when a job runs
    from orchestrator.observe.progress import ProgressView

    job = build_config(config, overrides=overrides, model_family=model_family)
    if resume_run is not None:
        run_dir = resumed_run_dir(job, resume_run)
    faults = parse_faults(list(inject))
    seed = None
    if chaos is not None:
        seed, drawn = chaos_faults(job, chaos)
        faults += drawn
    if not progress:
        return run_training(job, run_dir, faults=faults, handle_signals=handle_signals, chaos_seed=seed)
    view = ProgressView(force_plain=plain_progress)
    return run_training(
        job,
        run_dir,
        subscribers=[view],
        console=view.console,
        faults=faults,
        handle_signals=handle_signals,
        chaos_seed=seed,
    )


def resumed_run_dir(job: JobConfig, record: str | Path) -> Path:
    """``--resume-run RUN_DIR``: the run directory to go on writing, once its config is ``job``'s."""
    from orchestrator.driver.adoption import check_same_config

    recorded = Path(record) / "config.yaml"
    if not recorded.is_file():
        raise UserError(f"--resume-run {record}: no config.yaml there; pass the run directory of an earlier run")
    check_same_config(recorded.read_text(encoding="utf-8"), job, where=str(record))
    return Path(record)


def chaos_faults(job: JobConfig, text: str) -> tuple[int, tuple[FaultSpec, ...]]:
    """``--chaos SEED[:N]``: the seed and the faults it draws for ``job`` (no node faults here:
    they need the test harness's cluster; no drains: on one node there is nowhere to go)."""
    from orchestrator.driver.chaos import chaos_kinds, chaos_schedule, parse_chaos

    seed, count = parse_chaos(text)
    mesh = job.mesh
    kinds = chaos_kinds(storage=job.checkpoint.uri is not None, nodes=False)
    faults = chaos_schedule(
        seed, count, steps=job.training.steps, world_size=mesh.world_size, replica_size=mesh.replica_size, kinds=kinds
    )
    return seed, faults


def parse_faults(texts: list[str]) -> tuple[FaultSpec, ...]:
    """``--inject`` texts as fault specs; a node fault needs the test harness's cluster."""
    faults = []
    for text in texts:
        try:
            fault = FaultSpec.parse(text)
        except ValueError as error:
            raise UserError(str(error)) from None
        if fault.kind == "node":
            raise UserError(
                f"--inject {text!r}: node faults need a multi-node test cluster "
                "(ray.cluster_utils.Cluster); use the pytest fault harness"
            )
        if fault.kind in NETWORK_KINDS:
            raise UserError(
                f"--inject {text!r}: network faults need a separate-network test cluster "
                "(tests/fixtures/netns_nodes.py); use bench/chaos.py --separate-networks or the fault harness"
            )
        faults.append(fault)
    return tuple(faults)


def build_config(
    config: ConfigSource = None,
    *,
    overrides: Iterable[str] | Mapping[str, Any] = (),
    model_family: type[ModelFamily] | str | None = None,
) -> JobConfig:
    """The validated ``JobConfig`` ``train`` would run (raises ``ConfigError`` listing every problem).

    A ``JobConfig`` built in code is checked as a YAML file would be, on a copy.
    """
    texts = _override_texts(overrides)
    if model_family is not None:
        texts.append(f"model.family={family_path(model_family)}")
    if isinstance(config, JobConfig):
        checked = config_from_dict(config.to_dict(), texts)
        checked.source_dir = config.source_dir
        return checked
    if isinstance(config, Mapping):
        return config_from_dict(dict(config), texts)
    return load_config(config, texts)


def family_path(family: type[ModelFamily] | str) -> str:
    """``package.module:Class`` for a family class (how ranks import it), or the name as given."""
    if isinstance(family, str):
        return family
    from workers.models import ModelFamily

    if not (isinstance(family, type) and issubclass(family, ModelFamily)):
        raise ConfigError(f"model_family={family!r}: pass a ModelFamily subclass or its 'package.module:Class' path")
    if family.__module__ == "__main__" or "<locals>" in family.__qualname__:
        raise ConfigError(
            f"model_family={family.__qualname__}: defined in __main__ or inside a function, so rank processes "
            "cannot import it; move it to a module of an installed package"
        )
    return f"{family.__module__}:{family.__qualname__}"


def _override_texts(overrides: Iterable[str] | Mapping[str, Any]) -> list[str]:
    """``--set`` texts; mapping values are written as YAML reads them back (JSON is YAML)."""
    if isinstance(overrides, Mapping):
        return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    return list(overrides)
