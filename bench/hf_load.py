"""Pretrained-load benchmark: a Hugging Face checkpoint into 2 ranks vs transformers in one process.

    python bench/hf_load.py            # a ~300 MB bfloat16 Llama checkpoint in 4 files
    python bench/hf_load.py --quick    # ~64 MB in 3 files, for a smoke run

``transformers`` writes a random Llama-shaped model (``LlamaConfig``, bfloat16 safetensors split
by ``max_shard_size``) into a temporary directory; a local SeaweedFS serves the same files over
S3 with auth. Measured in one run, rounds interleaved (each round rotates the order), medians:

- ours: two ranks (spawned processes, gloo) each build the ``Trainer`` of MeshSpec(dp_shard=2)
  from the saved config.json (``llama_spec_from_hf``, float32 parameters) once, then time
  ``workers.pretrained.load_pretrained`` alone, from the directory and from S3: the listing,
  config.json, the index and every file's header, the read plan, the ranged reads of its own
  rows and their bf16 -> fp32 copy into its shards. The figure is the slowest rank's time.
- reference: ``transformers.AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)`` in
  this process (local disk), timed around that call: config.json, building the model, reading
  every file and the dtype conversion.

Not included on either side: interpreter start-up, imports, process-group set-up and building our
model. The first load of each kind (lazy imports, caches) is a warm-up, reported apart. The files
were just written, so both sides read them from the page cache. Bytes: what each rank read
against the size of all tensors (which transformers reads in full).

The last stdout line is one JSON object with our figures, the reference and the ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import emit  # noqa: E402

WORLD_SIZE = 2
KINDS = ("ours_disk", "ours_s3", "transformers")


def llama_config(quick: bool) -> dict[str, Any]:
    """A Llama 3-shaped decoder: 32 M parameters (64 MB in bf16) quick, 150 M (300 MB) full."""
    if quick:
        shape = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "vocab_size": 8192}
    else:
        shape = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 16, "vocab_size": 32000}
    heads = shape["hidden_size"] // 64
    return {**shape, "num_attention_heads": heads, "num_key_value_heads": heads // 2, "max_position_embeddings": 2048}


def save_checkpoint(directory: Path, quick: bool) -> int:
    """Write the random model as transformers releases one; returns its parameter count."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # stderr keeps to one line per round
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**llama_config(quick)), dtype=torch.bfloat16
    )
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="25MB" if quick else "100MB")
    count = sum(param.numel() for param in model.parameters())
    del model
    gc.collect()
    return count


def upload(directory: Path, uri: str, endpoint_url: str) -> None:
    from checkpointing.storage import open_storage

    storage = open_storage(uri, endpoint_url=endpoint_url)
    try:
        for path in sorted(directory.iterdir()):
            with path.open("rb") as file:
                storage.put_stream(path.name, iter(lambda: file.read(8 << 20), b""), size=path.stat().st_size)
    finally:
        storage.close()


# ---------------------------------------------------------------------------------- ranks
def rank_main(rank: int, args: dict[str, Any], commands, results) -> None:
    try:
        _rank_main(rank, args, commands, results)
    except BaseException:  # noqa: BLE001 - reported to the parent process, whatever it was
        import traceback

        results.put(("error", rank, traceback.format_exc()))


def _rank_main(rank: int, args: dict[str, Any], commands, results) -> None:
    """One rank: build the trainer once, then load each source the parent sends, timed."""
    import torch.distributed as dist

    from elastic.spec import MeshSpec
    from workers.data import SyntheticSource
    from workers.pretrained import load_pretrained
    from workers.runtime import init_generation
    from workers.spec import TrainSpec
    from workers.spec.families.llama_hf import llama_spec_from_hf
    from workers.trainer import Trainer

    torch.set_num_threads(1)
    os.environ.update(args["env"])
    store = dist.FileStore(args["store_path"], WORLD_SIZE)
    init_generation(store=store, generation=0, rank=rank, world_size=WORLD_SIZE, backend="gloo", timeout_s=600)
    config = json.loads((Path(args["model_dir"]) / "config.json").read_text())
    model = llama_spec_from_hf(config, "config.json")
    spec = TrainSpec(model=model, steps=1, global_batch=2, seq_len=32, microbatch_size=1, microbatches=1)
    source = SyntheticSource(vocab_size=model.vocab_size, seq_len=spec.seq_len, seed=0)
    trainer = Trainer(spec, MeshSpec(dp_shard=WORLD_SIZE), rank, device=torch.device("cpu"), source=source)
    results.put(("ready", rank, None))
    while (pretrained := commands.get()) is not None:
        dist.barrier()  # both ranks start together, as in a fresh run
        started = time.perf_counter()
        report = load_pretrained(trainer, pretrained)
        seconds = time.perf_counter() - started
        results.put(("load", rank, (seconds, report.bytes_read, report.bytes_total)))
    dist.barrier()
    dist.destroy_process_group()


class Ranks:
    """The two rank processes, driven from here one load at a time."""

    def __init__(self, args: dict[str, Any]) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.results = context.Queue()
        self.commands = [context.Queue() for _ in range(WORLD_SIZE)]
        self.processes = [
            context.Process(target=rank_main, args=(rank, args, self.commands[rank], self.results), daemon=True)
            for rank in range(WORLD_SIZE)
        ]
        for process in self.processes:
            process.start()
        self._collect("ready")

    def load(self, source) -> dict[int, tuple[float, int, int]]:
        """Each rank's (seconds, bytes read, bytes of all tensors) for one load of ``source``."""
        for queue in self.commands:
            queue.put(source)
        return self._collect("load")

    def _collect(self, expected: str) -> dict[int, Any]:
        outcomes: dict[int, Any] = {}
        while len(outcomes) < WORLD_SIZE:
            kind, rank, payload = self.results.get(timeout=600)
            if kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            assert kind == expected, (kind, expected)
            outcomes[rank] = payload
        return outcomes

    def close(self) -> None:
        for queue in self.commands:
            queue.put(None)
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def transformers_load(model_dir: Path) -> float:
    """The reference: one ``from_pretrained`` of the same files in this process, timed."""
    import transformers

    started = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seconds = time.perf_counter() - started
    assert next(model.parameters()).dtype == torch.float32
    del model
    gc.collect()
    return seconds


# ---------------------------------------------------------------------------------- driver
def run(quick: bool) -> dict[str, Any]:
    from checkpointing.local_s3 import LocalS3Server
    from workers.spec.train import PretrainedSource

    with LocalS3Server() as server, tempfile.TemporaryDirectory(prefix="bench-hf-") as work:
        model_dir = Path(work) / "model"
        print(f"writing the checkpoint with transformers into {model_dir}", file=sys.stderr)
        params = save_checkpoint(model_dir, quick)
        files = sorted(path.name for path in model_dir.glob("*.safetensors"))
        server.create_bucket("bench")
        os.environ.update(server.env())  # AWS_* for our storage client, as a user's shell would hold them
        upload(model_dir, "s3://bench/model", server.endpoint_url)
        sources = {
            "ours_disk": PretrainedSource(str(model_dir)),
            "ours_s3": PretrainedSource("s3://bench/model", endpoint_url=server.endpoint_url),
        }
        args = {"env": server.env(), "store_path": os.path.join(work, "store"), "model_dir": str(model_dir)}
        ranks = Ranks(args)
        try:
            loads = interleaved_rounds(ranks, sources, model_dir, rounds=2 if quick else 5)
        finally:
            ranks.close()
    return summarize(loads, quick=quick, params=params, files=files)


def interleaved_rounds(ranks: Ranks, sources: dict, model_dir: Path, *, rounds: int) -> dict[str, list[dict]]:
    """A warm-up load of each kind, then ``rounds`` rounds, each in a rotated order.

    Every entry is {rank: (seconds, bytes read, bytes total)}; the reference's rank is 0.
    """
    loads: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for round_number in range(rounds + 1):
        order = KINDS[round_number % 3 :] + KINDS[: round_number % 3]
        for kind in order:
            if kind == "transformers":
                loads[kind].append({0: (transformers_load(model_dir), 0, 0)})
            else:
                loads[kind].append(ranks.load(sources[kind]))
        seconds = {kind: round(max(v[0] for v in loads[kind][-1].values()), 3) for kind in KINDS}
        print(f"round {round_number}{' (warm-up)' if round_number == 0 else ''}: {seconds}", file=sys.stderr)
    return loads


def summarize(loads: dict[str, list[dict]], *, quick: bool, params: int, files: list[str]) -> dict[str, Any]:
    def slowest(kind: str) -> list[float]:
        """Per load, the slowest rank (a fresh run waits for it)."""
        return [max(values[0] for values in load.values()) for load in loads[kind]]

    medians = {kind: statistics.median(slowest(kind)[1:]) for kind in KINDS}
    total = loads["ours_disk"][-1][0][2]
    fractions = {
        kind: [round(loads[kind][-1][rank][1] / total, 3) for rank in range(WORLD_SIZE)]
        for kind in ("ours_disk", "ours_s3")
    }
    figures: dict[str, Any] = {
        "quick": quick,
        "ranks": WORLD_SIZE,
        "mesh": "dp_shard=2",
        "params_m": round(params / 1e6, 1),
        "checkpoint_mb": round(total / 1e6, 1),
        "files": len(files),
        "load_s": {kind: round(seconds, 3) for kind, seconds in medians.items()},
        "load_ratio_disk_vs_transformers": round(medians["ours_disk"] / medians["transformers"], 2),
        "load_ratio_s3_vs_transformers": round(medians["ours_s3"] / medians["transformers"], 2),
        "first_load_s": {kind: round(slowest(kind)[0], 3) for kind in KINDS},
        "bytes_read_mb_per_rank": {
            kind: [round(loads[kind][-1][rank][1] / 1e6, 1) for rank in range(WORLD_SIZE)]
            for kind in ("ours_disk", "ours_s3")
        },
        "bytes_total_mb": round(total / 1e6, 1),
        "bytes_fraction_per_rank": fractions,
        # Every round (slowest rank), to show the spread on a shared machine.
        "rounds": {kind: [round(seconds, 3) for seconds in slowest(kind)[1:]] for kind in KINDS},
    }
    figures["goals_met"] = {
        "load_disk_vs_transformers<=1x": figures["load_ratio_disk_vs_transformers"] <= 1.0,
        "load_s3_vs_transformers<=1x": figures["load_ratio_s3_vs_transformers"] <= 1.0,
        "bytes_per_rank<=0.6_of_total": max(max(f) for f in fractions.values()) <= 0.6,
    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~64 MB checkpoint, fewer rounds")
    figures = run(parser.parse_args().quick)
    for key, value in figures.items():
        print(f"{key:>32}: {value}", file=sys.stderr)
    emit(figures)


if __name__ == "__main__":
    main()
