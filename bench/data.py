"""Data benchmark: ``meshpilot data prepare`` vs a plain ``encode_batch`` loop, and the ranks' reads in training.

    python bench/data.py            # a 16 MB .jsonl, 5 rounds; then 2 training runs of 20 steps (~3 min)
    python bench/data.py --quick    # 4 MB (1 MiB read chunks), 2 rounds; runs of 12 steps (~1 min)

A generated ``.jsonl`` of documents (pseudo-words, Zipf-distributed) and a byte-level BPE tokenizer
trained on its first documents with the ``tokenizers`` library (8,192 tokens; 4,096 quick) are written
into a temporary directory. Then, in one run:

(1) Prepare throughput, tokens per second, medians over interleaved rounds (each round rotates the
    order), the first round a warm-up reported apart:

    - ours: ``prepare_corpus`` (what ``meshpilot data prepare`` runs) on an embedded Ray cluster of
      this machine's CPUs, started once before the rounds: its start-up is reported apart, not in the
      figure. Timed around the call: inputs, tokenizer, the Ray Data passes (read + tokenize tasks
      writing pieces, then the tasks building each shard from its pieces), the driver's shard plan,
      every shard fsynced, the manifest. Three kinds: no ``--workers``
      (as a user runs it: one task per cluster CPU), ``--workers 1`` and ``--workers 2``.
    - reference: one process, no Ray: load the same ``tokenizer.json``, read the ``.jsonl`` line by line,
      ``encode_batch`` 1,024 documents at a time, append the EOS id, write the same ``uint16`` tokens to
      one file, fsync it. ``tokenizers`` spreads ``encode_batch`` over every core by itself, so the
      reference already uses both cores of this machine.

    Both sides must produce the same number of tokens.
(2) Read time in training: a 2-rank run (dp_shard=2, the debug model with ``model.vocab_size`` = the
    tokenizer's) on the prepared corpus (``data.source=tokens``), through ``run_training`` as
    ``meshpilot train`` does. Every step event carries ``phases_s.data_s`` (the slowest rank's wait for
    its samples) and ``step_time_s`` (the slowest rank's step); the figure is data_s / step_time_s, its
    median and max over the steps that are not the first of a generation (nothing is prefetched
    before that one: reported apart). Reference, same process: the same run on ``data.source=synthetic``
    (samples made in memory, nothing read).

The last stdout line is one JSON object with our figures, the references and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit  # noqa: E402

KINDS = ("ours", "ours_workers1", "ours_workers2", "encode_batch")
WORKERS: dict[str, int | None] = {"ours": None, "ours_workers1": 1, "ours_workers2": 2}
ENCODE_BATCH_DOCUMENTS = 1024
EOS_TOKEN = "<eos>"
# A step that is the first of its generation follows one of these events (nothing prefetched yet).
GENERATION_STARTS = ("start", "recovered", "grow")
PREPARE_GOAL = 0.8  # ours / encode_batch tokens per second, at least
READ_GOAL = 0.02  # data_s / step_time_s, at most


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"corpus_mb": 4, "chunk_mb": 1.0, "vocab_size": 4096, "rounds": 2, "steps": 12}
    return {"corpus_mb": 16, "chunk_mb": 4.0, "vocab_size": 8192, "rounds": 5, "steps": 20}


# ---------------------------------------------------------------------------------- inputs
def pseudo_words(rng: random.Random, count: int) -> list[str]:
    """Words of 1-4 syllables, some capitalised or with accents: enough variety for BPE to learn merges."""
    syllables = [c + v for c in "bcdfghjklmnprstvwzß" for v in ("a", "e", "i", "o", "u", "é", "ö", "ai")]
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(count)})
    return [word.capitalize() if rng.random() < 0.1 else word for word in words]  # the same on every run


def write_corpus(path: Path, megabytes: int, seed: int = 0) -> int:
    """A ``.jsonl`` of about ``megabytes`` MB, one ``{"id", "text"}`` object per line; returns its documents."""
    rng = random.Random(seed)
    words = pseudo_words(rng, 20_000)
    weights = [1.0 / rank for rank in range(1, len(words) + 1)]  # Zipf: a few words are most of the text
    documents = 0
    with open(path, "w", encoding="utf-8") as handle:
        while handle.tell() < megabytes * 1_000_000:
            sentences = []
            for _ in range(rng.randint(1, 12)):
                sentence = " ".join(rng.choices(words, weights, k=rng.randint(4, 30)))
                sentences.append(sentence + rng.choice([".", ".", "!", "?", f" ({rng.randint(0, 9999)})."]))
            handle.write(json.dumps({"id": documents, "text": " ".join(sentences)}, ensure_ascii=False) + "\n")
            documents += 1
    return documents


def train_tokenizer(jsonl: Path, directory: Path, vocab_size: int, documents: int = 2000) -> int:
    """A byte-level BPE ``tokenizer.json`` (``<eos>`` its EOS) in ``directory``; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(jsonl, encoding="utf-8") as handle:
        texts = [json.loads(line)["text"] for line, _ in zip(handle, range(documents))]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer.get_vocab_size(with_added_tokens=True)


# ---------------------------------------------------------------------------------- prepare
def encode_batch_loop(jsonl: Path, tokenizer_dir: Path, out: Path) -> tuple[float, int]:
    """The reference: (seconds, tokens) of one process tokenizing ``jsonl`` into ``out`` as uint16."""
    import numpy as np
    from tokenizers import Tokenizer

    started = time.perf_counter()
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    assert eos_id is not None, f"the tokenizer has no {EOS_TOKEN}"
    tokens = 0

    def write(texts: list[str], handle) -> int:
        pieces = []
        for encoding in tokenizer.encode_batch(texts):
            ids = encoding.ids
            ids.append(eos_id)
            pieces.append(np.asarray(ids, dtype="<u2").tobytes())
        handle.write(b"".join(pieces))
        return sum(len(piece) for piece in pieces) // 2

    with open(jsonl, encoding="utf-8") as source, open(out, "wb") as handle:
        texts: list[str] = []
        for line in source:
            if line.strip():
                texts.append(json.loads(line)["text"])
            if len(texts) == ENCODE_BATCH_DOCUMENTS:
                tokens += write(texts, handle)
                texts = []
        if texts:
            tokens += write(texts, handle)
        handle.flush()
        os.fsync(handle.fileno())  # as durable as our shards
    return time.perf_counter() - started, tokens


def start_cluster() -> float:
    """Start the embedded cluster ``prepare_corpus`` would start (same call), timed; it stays up."""
    from orchestrator.data_prep.pipeline import DATA_PACKAGES
    from orchestrator.driver.cluster import connect_to

    started = time.perf_counter()
    assert connect_to(None, num_cpus=os.cpu_count() or 1, packages=DATA_PACKAGES), "a Ray cluster was already up"
    return time.perf_counter() - started


def prepare(
    jsonl: Path, tokenizer_dir: Path, out: Path, *, workers: int | None, chunk_mb: float
) -> tuple[float, int, float]:
    """(seconds, tokens, seconds of the Ray Data pass) of one ``prepare_corpus`` on the running cluster."""
    from orchestrator.data_prep.pipeline import PrepareRequest, prepare_corpus

    request = PrepareRequest(
        inputs=(str(jsonl),),
        tokenizer=str(tokenizer_dir),
        out=str(out),
        workers=workers,
        chunk_bytes=int(chunk_mb * 2**20),
    )
    started = time.perf_counter()
    result = prepare_corpus(request)
    return time.perf_counter() - started, result.tokens, result.seconds


def interleaved_rounds(work: Path, jsonl: Path, tokenizer_dir: Path, *, rounds: int, chunk_mb: float) -> dict:
    """A warm-up of each kind, then ``rounds`` rounds in a rotated order: per kind, [(seconds, tokens, pass_s)].

    Every output is deleted after its round except the last corpus of ``ours``, which training reads
    (``work/corpus``).
    """
    runs: dict[str, list[tuple[float, int, float]]] = {kind: [] for kind in KINDS}
    for round_number in range(rounds + 1):
        order = KINDS[round_number % len(KINDS) :] + KINDS[: round_number % len(KINDS)]
        for kind in order:
            out = work / f"out-{kind}-{round_number}"
            if kind == "encode_batch":
                seconds, tokens = encode_batch_loop(jsonl, tokenizer_dir, out)
                runs[kind].append((seconds, tokens, seconds))
                out.unlink()
                continue
            runs[kind].append(prepare(jsonl, tokenizer_dir, out, workers=WORKERS[kind], chunk_mb=chunk_mb))
            if kind == "ours" and round_number == rounds:
                out.rename(work / "corpus")
            else:
                shutil.rmtree(out)
        latest = {kind: round(runs[kind][-1][0], 2) for kind in KINDS}
        print(f"round {round_number}{' (warm-up)' if round_number == 0 else ''}: {latest} s", file=sys.stderr)
    return runs


def summarize_prepare(runs: dict[str, list[tuple[float, int, float]]], *, start_up_s: float) -> dict[str, Any]:
    """Tokens per second per kind (medians, the warm-up left out), ratios to the reference, scaling."""
    counts = {tokens for kind_runs in runs.values() for _, tokens, _ in kind_runs}
    if len(counts) != 1:
        raise SystemExit(f"the kinds produced different token counts: {sorted(counts)}")
    tokens = counts.pop()
    rate = {kind: tokens / statistics.median(seconds for seconds, _, _ in runs[kind][1:]) for kind in KINDS}
    return {
        "tokens": tokens,
        "tokens_per_s": {kind: round(value) for kind, value in rate.items()},
        "prepare_ratio_vs_encode_batch": round(rate["ours"] / rate["encode_batch"], 2),
        "prepare_ratio_workers1_vs_encode_batch": round(rate["ours_workers1"] / rate["encode_batch"], 2),
        "prepare_ratio_workers2_vs_encode_batch": round(rate["ours_workers2"] / rate["encode_batch"], 2),
        "workers2_vs_workers1": round(rate["ours_workers2"] / rate["ours_workers1"], 2),
        # The Ray Data pass alone (first read task to last document taken), from PrepareResult.seconds.
        "ray_data_pass_s": {
            kind: round(statistics.median(pass_s for _, _, pass_s in runs[kind][1:]), 3) for kind in WORKERS
        },
        "seconds": {kind: round(statistics.median(s for s, _, _ in runs[kind][1:]), 3) for kind in KINDS},
        "first_run_s": {kind: round(runs[kind][0][0], 3) for kind in KINDS},
        "cluster_start_s": round(start_up_s, 2),
        # Every round, to show the spread on a shared machine.
        "rounds_s": {kind: [round(seconds, 3) for seconds, _, _ in runs[kind][1:]] for kind in KINDS},
    }


# ---------------------------------------------------------------------------------- training
def train_job(source: str, *, corpus: Path, vocab_size: int, steps: int) -> dict[str, Any]:
    data: dict[str, Any] = {"source": source}
    if source == "tokens":
        data["uri"] = str(corpus)
    return {
        "name": f"bench-data-{source}",
        "model": {"preset": "debug", "vocab_size": vocab_size},
        "parallelism": {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1},
        "training": {"steps": steps, "global_batch": 16, "seq_len": 128, "warmup_steps": 2},
        "data": data,
        "metrics": {"enabled": False},
    }


def train_events(job: dict[str, Any], run_dir: Path) -> list[dict[str, Any]]:
    """One in-process ``meshpilot train`` (its own embedded cluster); its events."""
    from orchestrator.config import config_from_dict
    from orchestrator.driver.run import run_training
    from orchestrator.observe.events import read_events

    result = run_training(config_from_dict(job), run_dir)
    if result.exit_code != 0:
        raise SystemExit(f"training on data.source={job['data']['source']} failed: {result.reason}")
    return read_events(run_dir / "events.jsonl")


def read_fractions(events: list[dict[str, Any]]) -> dict[str, Any]:
    """data_s / step_time_s per step: median and max of the steady steps, the first of each generation apart."""
    steady: list[float] = []
    first: list[float] = []
    data_s: list[float] = []
    generation_started = False
    for event in events:
        if event["event"] in GENERATION_STARTS:
            generation_started = True
        if event["event"] != "step":
            continue
        fraction = event["phases_s"]["data_s"] / event["step_time_s"]
        (first if generation_started else steady).append(fraction)
        if not generation_started:
            data_s.append(event["phases_s"]["data_s"])
        generation_started = False
    step_times = [e["step_time_s"] for e in events if e["event"] == "step"]
    return {
        "median": round(statistics.median(steady), 5),
        "max": round(max(steady), 5),
        "first_of_generation": [round(fraction, 4) for fraction in first],
        "median_data_ms": round(statistics.median(data_s) * 1e3, 3),
        "median_step_s": round(statistics.median(step_times), 4),
        "steps": len(step_times),
    }


def summarize(prepare_figures: dict[str, Any], reads: dict[str, dict[str, Any]], **run: Any) -> dict[str, Any]:
    figures: dict[str, Any] = {**run, **prepare_figures, "read_fraction": reads}
    figures["goals_met"] = {
        f"prepare_vs_encode_batch>={PREPARE_GOAL}x": prepare_figures["prepare_ratio_vs_encode_batch"] >= PREPARE_GOAL,
        f"read_fraction_max<={READ_GOAL}": reads["tokens"]["max"] <= READ_GOAL,
    }
    return figures


# ---------------------------------------------------------------------------------- driver
def run(quick: bool) -> dict[str, Any]:
    import ray

    size = sizes(quick)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as work_dir:
        work = Path(work_dir)
        jsonl, tokenizer_dir = work / "docs.jsonl", work / "tokenizer"
        documents = write_corpus(jsonl, size["corpus_mb"])
        vocab_size = train_tokenizer(jsonl, tokenizer_dir, size["vocab_size"])
        print(f"{documents} documents, {jsonl.stat().st_size / 1e6:.1f} MB; vocabulary {vocab_size}", file=sys.stderr)
        start_up_s = start_cluster()
        print(f"Ray cluster started in {start_up_s:.2f} s", file=sys.stderr)
        try:
            runs = interleaved_rounds(work, jsonl, tokenizer_dir, rounds=size["rounds"], chunk_mb=size["chunk_mb"])
        finally:
            ray.shutdown()  # each training run starts a cluster of its own, sized for its ranks
        reads = {}
        for source in ("tokens", "synthetic"):
            job = train_job(source, corpus=work / "corpus", vocab_size=vocab_size, steps=size["steps"])
            reads[source] = read_fractions(train_events(job, work / f"run-{source}"))
            print(f"training on {source}: {reads[source]}", file=sys.stderr)
        return summarize(
            summarize_prepare(runs, start_up_s=start_up_s),
            reads,
            quick=quick,
            corpus_mb=round(jsonl.stat().st_size / 1e6, 1),
            documents=documents,
            vocab_size=vocab_size,
            chunk_mb=size["chunk_mb"],
            cluster_cpus=os.cpu_count(),
            train_mesh="dp_shard=2",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4 MB corpus, fewer rounds and steps")
    figures = run(parser.parse_args().quick)
    for key, value in figures.items():
        print(f"{key:>40}: {value}", file=sys.stderr)
    emit(figures)


if __name__ == "__main__":
    main()
