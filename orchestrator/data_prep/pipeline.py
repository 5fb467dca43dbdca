"""``prepare_corpus``: inputs -> Ray Data (read, tokenize) -> shards in input order -> the manifest (driver).

Runs on the driver. The order of the steps is the contract:

    1. check the request; resolve the inputs; load the tokenizer (and chat template); plan the read chunks
       (no Ray yet)
    2. read --out: a committed corpus of other settings is refused here, before any work
    3. connect to Ray (--address, RAY_ADDRESS, else an embedded cluster) and run one dataset:
       from_items(chunks) -> map_batches(read_documents) -> map_batches(tokenize_documents),
       with ``preserve_order`` so documents reach the driver in input order, whatever ran first
    4. the driver numbers each input's documents, puts each in its split by
       ``is_validation(split_seed, input, document)``, and feeds the split's shard writer
       (tokens, and for a masked corpus the mask bytes, cut into shards at the same places)
    5. every shard durable -> the manifest with put-if-absent (the commit)

Any failure before 5 deletes the shards this run wrote and leaves no manifest; the first bad line
in input order becomes one ``UserError`` naming the file and line.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from checkpointing.errors import CheckpointError
from checkpointing.storage import StorageBackend, open_storage
from orchestrator.data_prep.chat import DEFAULT_TRAIN_ON, DocumentRecipe, TrainOn
from orchestrator.data_prep.inputs import DEFAULT_CHUNK_BYTES, InputFile, locate, plan_chunks, resolve_inputs
from orchestrator.data_prep.progress import ProgressSink, SilentProgress
from orchestrator.data_prep.reading import ReadChunk, RecordFields, read_documents
from orchestrator.data_prep.tokenize import TokenizerFile, load_chat_template, load_tokenizer, tokenize_documents
from orchestrator.data_prep.writing import (
    ShardUploader,
    SplitWriter,
    commit_manifest,
    committed_manifest,
    refuse_other_corpus,
    remove_strays,
    with_splits,
)
from orchestrator.driver.cluster import WORKER_PACKAGES, connect_to
from orchestrator.errors import UserError
from workers.spec.tokens import DTYPES, SPLITS, CorpusFormat, TokenManifest, is_validation

log = logging.getLogger("meshpilot")
# The tasks run orchestrator.data_prep's reading and tokenizing functions: a remote cluster gets it too.
DATA_PACKAGES = (*WORKER_PACKAGES, "orchestrator")


@dataclass(frozen=True)
class PrepareRequest:
    """What ``meshpilot data prepare`` was asked; the flags of the same names."""

    inputs: tuple[str, ...]
    tokenizer: str
    out: str
    text_field: str = "text"
    corpus_format: CorpusFormat = CorpusFormat.TEXT
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    train_on: TrainOn | None = None  # None: the format's default (DEFAULT_TRAIN_ON)
    eos_token: str | None = None
    validation_fraction: float = 0.01
    split_seed: int = 0
    shard_mb: float = 128.0
    address: str | None = None
    endpoint_url: str | None = None
    region: str | None = None
    workers: int | None = None  # concurrent read+tokenize tasks; None: as many as the cluster's CPUs allow
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    @property
    def fields(self) -> RecordFields:
        names = {
            CorpusFormat.TEXT: (self.text_field,),
            CorpusFormat.CHAT: (self.messages_field,),
            CorpusFormat.PROMPT_COMPLETION: (self.prompt_field, self.completion_field),
        }
        return RecordFields(self.corpus_format, names[self.corpus_format])


@dataclass(frozen=True)
class PrepareResult:
    uri: str
    manifest: TokenManifest
    committed: bool  # False: --out already held this very corpus, and still does
    shards_written: int  # new shards (a fresh corpus)
    shards_repaired: int  # shards of the committed corpus that were missing, written again identical
    seconds: float  # from the first read task to the last document taken

    @property
    def documents(self) -> int:
        return sum(split.documents for split in self.manifest.splits.values())

    @property
    def tokens(self) -> int:
        return sum(split.tokens for split in self.manifest.splits.values())


def prepare_corpus(request: PrepareRequest, *, progress: ProgressSink | None = None) -> PrepareResult:
    """Tokenize the inputs into a committed token corpus at ``request.out`` (see the module docstring)."""
    _check_request(request)
    where = {"endpoint_url": request.endpoint_url, "region": request.region}
    with _storage_errors_of("--input"):
        files = resolve_inputs(list(request.inputs), **where)
        chunks = plan_chunks(files, fields=request.fields, chunk_bytes=request.chunk_bytes, **where)
    with _storage_errors_of("--tokenizer"):
        tokenizer = load_tokenizer(request.tokenizer, eos_token=request.eos_token, **where)
        template = (
            load_chat_template(request.tokenizer, **where) if request.corpus_format == CorpusFormat.CHAT else None
        )
    recipe = DocumentRecipe(
        corpus_format=request.corpus_format,
        train_on=request.train_on or DEFAULT_TRAIN_ON[request.corpus_format],
        template=template,
    )
    draft = TokenManifest(
        dtype=tokenizer.dtype,
        tokenizer=tokenizer.info,
        validation_fraction=request.validation_fraction,
        split_seed=request.split_seed,
        splits={},
        inputs=tuple(file.uri for file in files),
        corpus_format=request.corpus_format,
        loss_mask=recipe.masked,
        fields=request.fields.names,
        chat_template_sha256=template.sha256 if template is not None else None,
    )
    with _storage_errors_of("--out"):
        out = open_storage(request.out, endpoint_url=request.endpoint_url, region=request.region)
        existing = committed_manifest(out)
        if existing is not None:
            refuse_other_corpus(existing, draft, out.uri)
        out.check_access()
    started_cluster = connect_to(request.address, num_cpus=os.cpu_count() or 1, packages=DATA_PACKAGES)
    try:
        return _write_corpus(
            request, out, files, chunks, (tokenizer, recipe), draft, existing, progress or SilentProgress()
        )
    finally:
        if started_cluster:
            import ray

            ray.shutdown()


@contextmanager
def _storage_errors_of(flag: str) -> Iterator[None]:
    """A storage failure (missing bucket, credentials, endpoint) names the flag whose location it concerns."""
    try:
        yield
    except CheckpointError as error:
        raise UserError(f"{flag}: {error}") from None


def _check_request(request: PrepareRequest) -> None:
    if not 0.0 <= request.validation_fraction < 1.0:
        raise UserError(f"--validation-fraction {request.validation_fraction}: give a fraction in [0, 1), e.g. 0.01")
    if not request.shard_mb > 0:
        raise UserError(f"--shard-mb {request.shard_mb}: give a positive size in MiB, e.g. 128")
    if request.workers is not None and request.workers < 1:
        raise UserError(f"--workers {request.workers}: give at least 1, or leave it out")
    for name, flag in zip(request.fields.names, request.fields.flags):
        if not name:
            raise UserError(f"{flag} is empty: name the field (or column) of each record that holds it")
    allowed = (TrainOn.ALL, DEFAULT_TRAIN_ON[request.corpus_format])
    if request.train_on is not None and request.train_on not in allowed:
        raise UserError(
            f"--train-on {request.train_on} does not apply to --format {request.corpus_format}; "
            f"give {' or '.join(sorted(set(allowed)))}"
        )


def _write_corpus(
    request: PrepareRequest,
    out: StorageBackend,
    files: list[InputFile],
    chunks: list[ReadChunk],
    encoding: tuple[TokenizerFile, DocumentRecipe],
    draft: TokenManifest,
    existing: TokenManifest | None,
    progress: ProgressSink,
) -> PrepareResult:
    tokenizer, recipe = encoding
    uploader = ShardUploader(out, committed=existing)
    itemsize = DTYPES[tokenizer.dtype]
    shard_tokens = max(1, int(request.shard_mb * 2**20) // itemsize)
    writers = {
        split: SplitWriter(split, uploader, itemsize=itemsize, shard_tokens=shard_tokens, masked=recipe.masked)
        for split in SPLITS
    }
    try:
        began = time.monotonic()
        progress.start(sum(file.size for file in files))
        try:
            batches = _documents(request, chunks, tokenizer, recipe)
            _route_documents(batches, request, files, writers, progress)
        finally:
            progress.finish()
        seconds = time.monotonic() - began
        manifest = with_splits(draft, writers)
        committed = commit_manifest(out, manifest)
    except BaseException:  # Ctrl-C included: nothing of a run that did not commit stays visible
        uploader.discard_written()
        raise
    uploader.close()
    if committed and existing is None:
        if strays := remove_strays(out, manifest):
            log.info("removed %d shard(s) an earlier attempt left under %s", strays, out.uri)
    return PrepareResult(
        uri=out.uri,
        manifest=manifest,
        committed=committed,
        shards_written=len(uploader.written),
        shards_repaired=uploader.repaired,
        seconds=seconds,
    )


def _route_documents(
    batches: Iterator[dict],
    request: PrepareRequest,
    files: list[InputFile],
    writers: dict[str, SplitWriter],
    progress: ProgressSink,
) -> None:
    """Number each input's documents in order, and hand each to its split's writer."""
    counts = [0] * len(files)
    itemsize = writers["train"].itemsize
    for batch in batches:
        errors, numbers, tokens, masks = batch["error"], batch["input"], batch["tokens"], batch["mask"]
        batch_tokens = 0
        for row in range(len(errors)):
            number = int(numbers[row])
            if errors[row]:
                where = locate(
                    files[number], int(batch["offset"][row]), endpoint_url=request.endpoint_url, region=request.region
                )
                raise UserError(f"{where} {errors[row]}")
            document = counts[number]
            counts[number] += 1
            held_out = is_validation(request.split_seed, number, document, request.validation_fraction)
            writers["validation" if held_out else "train"].append(tokens[row], masks[row])
            batch_tokens += len(tokens[row]) // itemsize
        progress.advance(documents=len(errors), tokens=batch_tokens, nbytes=int(batch["span"].sum()))
    empty = [file.uri for file, count in zip(files, counts) if count == 0]
    if empty:
        raise UserError(f"input {empty[0]} holds no documents (only blank lines); remove it from --input")


def _documents(
    request: PrepareRequest, chunks: list[ReadChunk], tokenizer: TokenizerFile, recipe: DocumentRecipe
) -> Iterator[dict]:
    """The tokenized documents, one batch per chunk, in input order (Ray Data tasks do the work)."""
    import ray.data

    compute = ray.data.TaskPoolStrategy(size=request.workers) if request.workers else None
    read = partial(read_documents, fields=request.fields, endpoint_url=request.endpoint_url, region=request.region)
    tokenize = partial(
        tokenize_documents,
        tokenizer_json=tokenizer.data,
        tokenizer_sha256=tokenizer.info.sha256,
        eos_id=tokenizer.info.eos_id,
        dtype=tokenizer.dtype,
        recipe=recipe,
    )
    with _quiet_ray_data(), ray.data.DataContext.current(_ordered_context()):
        rows = [chunk.to_row() for chunk in chunks]
        dataset: ray.data.Dataset = ray.data.from_items(rows, override_num_blocks=len(chunks))
        dataset = dataset.map_batches(read, batch_size=1, compute=compute)  # one chunk per call
        dataset = dataset.map_batches(tokenize, batch_size=None, compute=compute)
        yield from dataset.iter_batches(batch_size=None, batch_format="numpy")


def _ordered_context() -> Any:
    """This run's Ray Data settings, on a copy: the caller's own context stays as it was."""
    import ray.data

    context = ray.data.DataContext.get_current().copy()
    context.execution_options.preserve_order = True  # the split and the shards follow input order
    context.enable_progress_bars = False  # ours counts documents and tokens
    context.print_on_execution_start = False
    return context


@contextmanager
def _quiet_ray_data() -> Iterator[None]:
    """Ray Data's own notices (execution plans, "progress bars disabled") are not ours to print."""
    logger = logging.getLogger("ray.data")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            # Copying a DataContext (Ray does it for every dataset) warns about its own deprecated fields.
            warnings.filterwarnings("ignore", category=DeprecationWarning, module="ray.data.context")
            yield
    finally:
        logger.setLevel(level)
