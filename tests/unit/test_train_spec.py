"""The job config becomes what ranks get in one place, with every optimizer setting declared once.

python -m pytest tests/unit/test_train_spec.py -q
"""

from __future__ import annotations

import dataclasses

from orchestrator.config import JobConfig, TrainingConfig, config_from_dict
from orchestrator.driver.train_spec import checkpoint_target, train_spec
from workers.spec.train import OptimizerSpec


def test_every_optimizer_setting_is_a_training_key_with_the_job_defaults():
    optimizer_keys = [f.name for f in dataclasses.fields(OptimizerSpec)]
    assert set(optimizer_keys) <= set(JobConfig().to_dict()["training"])
    assert {key: getattr(TrainingConfig(), key) for key in optimizer_keys} == {
        "lr": 3.0e-4,
        "min_lr_ratio": 0.1,
        "warmup_steps": 5,
        "weight_decay": 0.1,
        "beta1": 0.9,
        "beta2": 0.95,
        "grad_clip": 1.0,
    }


def test_every_optimizer_setting_reaches_the_ranks():
    settings = {
        "lr": 1e-3,
        "min_lr_ratio": 0.25,
        "warmup_steps": 3,
        "weight_decay": 0.05,
        "beta1": 0.8,
        "beta2": 0.9,
        "grad_clip": 0.5,
    }
    spec = train_spec(config_from_dict({"data": {"source": "synthetic"}, "training": settings}))
    assert {key: getattr(spec, key) for key in settings} == settings


def test_the_microbatch_size_comes_from_the_configured_mesh():
    config = config_from_dict(
        {
            "data": {"source": "synthetic"},
            "training": {"global_batch": 32},
            "parallelism": {"dp_replicate": 2, "dp_shard": 2, "tp": 1, "pp": 2, "microbatches": 4},
        }
    )
    spec = train_spec(config)
    assert (spec.global_batch, spec.microbatch_size, spec.microbatches) == (32, 2, 4)
    assert spec.batch.accumulation(4) == 1 and spec.batch.accumulation(2) == 2


def test_the_checkpoint_target_takes_every_setting():
    config = config_from_dict(
        {
            "data": {"source": "synthetic"},
            "checkpoint": {
                "uri": "s3://bucket/run",
                "endpoint_url": "http://127.0.0.1:9000",
                "region": "eu-west-1",
                "interval_steps": 7,
                "async": False,
                "part_size_mb": 16,
                "upload_concurrency": 2,
                "max_in_flight": 3,
            },
        }
    )
    target = checkpoint_target(config)
    assert dataclasses.asdict(target) == {
        "uri": "s3://bucket/run",
        "endpoint_url": "http://127.0.0.1:9000",
        "region": "eu-west-1",
        "interval_steps": 7,
        "async_save": False,
        "part_size_bytes": 16 << 20,
        "upload_concurrency": 2,
        "max_in_flight": 3,
    }
    assert checkpoint_target(JobConfig()) is None
