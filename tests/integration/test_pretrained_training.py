"""Training from released weights on real components: embedded Ray, gloo, SeaweedFS S3 with auth,
and ``transformers`` writing the weights and loading what we export.

- 10 steps on tp=2 x pp=2 x dp_shard=2 from a Hugging Face directory take the losses of one
  rank from the same weights (within 1e-3 relative), for a Qwen2 with tied embeddings (as
  Qwen2-0.5B is released): q/k/v biases, and the first and the last stage read the same tensor
  (SmolLM's tie, through the same loader); Llama 3's rope scaling, Mistral, and SmolLM and Qwen2
  as ``tests/hf_models.py`` builds them are covered by the logits on the same mesh
  (tests/ranks/test_pretrained_load.py);
- the same load from S3: each rank reads about its own share of the files, and says so;
- ``ckpt import`` then a run that resumes from it trains exactly as a run from ``init_from``
  (a checkpoint takes precedence over ``init_from``); the export of that run generates text
  in ``transformers``, offline.
"""

from __future__ import annotations

import pytest
import torch

from checkpointing.storage import open_storage
from orchestrator.cli import main
from tests.hf_models import save_random_model
from tests.jobs import losses, single_rank, train

STEPS = 10


def _pretrained_events(events):
    return [e for e in events if e["event"] == "pretrained_loaded"]


@pytest.mark.slow
def test_eight_ranks_from_released_weights_match_one_rank(ray_cluster, tmp_path):
    # One model with both: q/k/v biases (Qwen2) and tied embeddings (SmolLM's, Qwen2-0.5B's).
    save_random_model("qwen2", tmp_path / "hf", dtype=torch.bfloat16, tie_word_embeddings=True)
    init = f"model.init_from={tmp_path / 'hf'}"
    result, events = train(tmp_path / "eight", init, f"training.steps={STEPS}")
    assert result.exit_code == 0, result.reason
    assert len(_pretrained_events(events)) == 8  # every rank loaded its own slices
    reference, reference_events = train(tmp_path / "one", init, f"training.steps={STEPS}", *single_rank())
    assert reference.exit_code == 0, reference.reason
    parallel, single = losses(events), losses(reference_events)
    assert sorted(parallel) == list(range(1, STEPS + 1))
    for step, expected in single.items():
        assert parallel[step] == pytest.approx(expected, rel=1e-3), f"step {step}"


def test_released_weights_from_s3_each_rank_reads_its_share(ray_cluster, s3_bucket, tmp_path):
    """Tensors of several MiB: neighbouring ranges less than 1 MiB apart are fetched in one GET,
    so a rank's half of a small tensor comes with the other half (fewer requests)."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=4096,
        max_position_embeddings=256,
    )
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
        tmp_path / "hf", max_shard_size="40MB"
    )
    uri = f"s3://{s3_bucket.name}/models/llama"
    storage = open_storage(uri, endpoint_url=s3_bucket.endpoint_url)
    for path in (tmp_path / "hf").iterdir():
        storage.put_bytes(path.name, path.read_bytes())
    result, events = train(
        tmp_path / "run",
        f"model.init_from={uri}",
        f"checkpoint.endpoint_url={s3_bucket.endpoint_url}",
        "training.steps=1",
        "training.global_batch=4",
        *single_rank("parallelism.dp_shard=2", "parallelism.microbatches=1"),
    )
    assert result.exit_code == 0, result.reason
    loads = _pretrained_events(events)
    assert sorted(e["rank"] for e in loads) == [0, 1]
    for load in loads:
        assert load["uri"] == uri
        assert 0.4 < load["bytes_read"] / load["bytes_total"] < 0.6, load


def test_import_resume_and_export_generate(ray_cluster, tmp_path, capsys, monkeypatch):
    save_random_model("llama3", tmp_path / "hf", dtype=torch.bfloat16)
    layout = single_rank("parallelism.dp_shard=2", "parallelism.microbatches=2")
    from_init, init_events = train(tmp_path / "init", f"model.init_from={tmp_path / 'hf'}", "training.steps=3", *layout)
    assert from_init.exit_code == 0, from_init.reason

    checkpoints = tmp_path / "ckpt"
    assert main(["ckpt", "import", str(tmp_path / "hf"), str(checkpoints)]) == 0, capsys.readouterr()
    resumed, resumed_events = train(
        tmp_path / "resumed",
        f"model.hf_config={tmp_path / 'hf'}",
        f"model.init_from={tmp_path / 'hf'}",  # the checkpoint under checkpoint.uri takes precedence
        f"checkpoint.uri={checkpoints}",
        "training.steps=3",
        *layout,
    )
    assert resumed.exit_code == 0, resumed.reason
    assert _pretrained_events(resumed_events) == []
    assert losses(resumed_events) == pytest.approx(losses(init_events), rel=1e-6)

    out = tmp_path / "exported"
    assert main(["ckpt", "export", str(checkpoints), "--out", str(out)]) == 0, capsys.readouterr()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    prompt = torch.tensor([[1, 2, 3, 4]])
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert generated.shape == (1, 10) and torch.equal(generated[:, :4], prompt)
