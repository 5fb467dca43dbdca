"""``prepare_corpus``: inputs -> Ray Data (read, tokenize, pieces) -> shard plans -> shards -> the manifest.

Runs on the driver; no token passes through it. The order of the steps is the contract:

    1. check the request; resolve the inputs; load the tokenizer (and chat template); plan the read chunks
       (no Ray yet)
    2. read --out: a committed corpus of other settings is refused here, before any work
    3. connect to Ray (--address, RAY_ADDRESS, else an embedded cluster) and run one dataset:
       from_items(chunks) -> map_batches(read_documents) -> map_batches(tokenize_documents)
       -> map_batches(write_pieces): the tasks write each batch's tokens (and mask bytes) as a piece
       under ``--out/.pieces/RUN/``, and only each document's place in its piece comes on, with
       ``preserve_order`` so that the driver takes the documents in input order, whatever ran first
    4. the driver numbers each input's documents, puts each in its split by
       ``is_validation(split_seed, input, document)``, and plans the split's shards as piece ranges
       (``writing.SplitPlan``: the cut of the split's token stream, whatever the chunks and tasks)
    5. a second dataset, from_items(shard plans) -> map_batches(assemble_shards): tasks build each
       shard (and mask shard) from ranged reads of its pieces and store it, or check it against a
       committed corpus; the driver writes each split's ``documents.bin`` (4 bytes a document)
    6. every shard durable -> the manifest with put-if-absent (the commit); the pieces are deleted

Any failure before 6 deletes what this run wrote (shards, pieces) and leaves no manifest; the first
bad line in input order becomes one ``UserError`` naming the file and line (the tasks still to run are
told to stop by a marker under ``.pieces/RUN/``, and drained, so none writes after the clean-up).
Storage traffic: each token is written twice (piece, shard) and read once; the driver moves only
document places and lengths.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from checkpointing.errors import CheckpointError
from checkpointing.storage import StorageBackend, open_storage
from orchestrator.data_prep.chat import DEFAULT_TRAIN_ON, DocumentRecipe, TrainOn
from orchestrator.data_prep.inputs import DEFAULT_CHUNK_BYTES, InputFile, locate, plan_chunks, resolve_inputs
from orchestrator.data_prep.pieces import (
    PIECES_PREFIX,
    Stored,
    abort_key,
    assemble_shards,
    read_unless_aborted,
    write_pieces,
)
from orchestrator.data_prep.progress import ProgressSink, SilentProgress
from orchestrator.data_prep.reading import ReadChunk, RecordFields
from orchestrator.data_prep.tokenize import TokenizerFile, load_chat_template, load_tokenizer, tokenize_documents
from orchestrator.data_prep.writing import (
    ShardOutcome,
    SplitPlan,
    commit_manifest,
    committed_manifest,
    committed_objects,
    planned_keys,
    refuse_changed_inputs,
    refuse_other_corpus,
    remove_strays,
    split_index,
    store_document_lengths,
)
from orchestrator.driver.cluster import WORKER_PACKAGES, connect_to
from orchestrator.errors import UserError
from workers.spec.tokens import DTYPES, SPLITS, CorpusFormat, TokenManifest, documents_key, is_validation

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
    itemsize = DTYPES[tokenizer.dtype]
    shard_tokens = max(1, int(request.shard_mb * 2**20) // itemsize)
    plans = {split: SplitPlan(split, shard_tokens) for split in SPLITS}
    run = RunPieces(out, uuid.uuid4().hex[:12])
    try:
        began = time.monotonic()
        progress.start(sum(file.size for file in files))
        try:
            batches = _documents(request, chunks, tokenizer, recipe, run)
            _route_documents(batches, request, files, plans, progress, run)
        finally:
            progress.finish()
        for plan in plans.values():
            plan.finish()
        manifest, stored = _store_shards(request, out, plans, draft, existing, itemsize)
        seconds = time.monotonic() - began
        committed = commit_manifest(out, manifest)
    except BaseException:  # Ctrl-C included: nothing of a run that did not commit stays visible
        if existing is None:  # (a committed corpus is only ever checked: nothing of it is this run's to delete)
            out.delete(planned_keys(plans))
        if pieces := run.delete():
            log.info("removed %d piece(s) of the failed run from %s", pieces, out.uri)
        raise
    run.delete()
    if committed and existing is None:
        if strays := remove_strays(out, manifest):
            log.info("removed %d shard(s) and piece(s) an earlier attempt left under %s", strays, out.uri)
    return PrepareResult(
        uri=out.uri,
        manifest=manifest,
        committed=committed,
        shards_written=stored[Stored.WRITTEN],
        shards_repaired=stored[Stored.REPAIRED],
        seconds=seconds,
    )


@dataclass(frozen=True)
class RunPieces:
    """This run's pieces under ``--out``: where they are, the abort marker, their removal (driver)."""

    out: StorageBackend
    run: str

    def abort(self) -> None:
        """Tell the tasks still to start that the run has failed: they return at once."""
        self.out.put_bytes(abort_key(self.run), b"")

    def delete(self) -> int:
        keys = [info.key for info in self.out.list(f"{PIECES_PREFIX}{self.run}/")]
        if keys:
            self.out.delete(keys)
        return sum(1 for key in keys if key.endswith(".bin"))


def _route_documents(
    batches: Iterator[dict],
    request: PrepareRequest,
    files: list[InputFile],
    plans: dict[str, SplitPlan],
    progress: ProgressSink,
    run: RunPieces,
) -> None:
    """Number each input's documents in order, and plan each into its split's shards.

    The first bad row in input order fails the run; the tasks still running are told to stop, and
    are waited for (they return at once), so that no piece is written after the run's are deleted.
    """
    counts = [0] * len(files)
    failure: UserError | None = None
    for batch in batches:
        if failure is not None:
            continue
        errors, numbers = batch["error"], batch["input"]
        pieces, positions, lengths, trained = batch["piece"], batch["position"], batch["length"], batch["trained"]
        for row in range(len(errors)):
            number = int(numbers[row])
            if errors[row]:
                offset = int(batch["offset"][row])
                where = locate(files[number], offset, endpoint_url=request.endpoint_url, region=request.region)
                failure = UserError(f"{where} {errors[row]}")
                run.abort()
                break
            document = counts[number]
            counts[number] += 1
            held_out = is_validation(request.split_seed, number, document, request.validation_fraction)
            plans["validation" if held_out else "train"].append(
                str(pieces[row]), int(positions[row]), int(lengths[row]), int(trained[row])
            )
        progress.advance(documents=len(errors), tokens=int(lengths.sum()), nbytes=int(batch["span"].sum()))
    if failure is not None:
        raise failure
    empty = [file.uri for file, count in zip(files, counts) if count == 0]
    if empty:
        raise UserError(f"input {empty[0]} holds no documents (only blank lines); remove it from --input")


def _documents(
    request: PrepareRequest, chunks: list[ReadChunk], tokenizer: TokenizerFile, recipe: DocumentRecipe, run: RunPieces
) -> Iterator[dict]:
    """Each document's place in the pieces, one batch per chunk, in input order (Ray Data tasks do the work)."""
    import ray.data

    compute = ray.data.TaskPoolStrategy(size=request.workers) if request.workers else None
    where: dict[str, Any] = {"endpoint_url": request.endpoint_url, "region": request.region}
    read = partial(read_unless_aborted, out_root=run.out.uri, run=run.run, fields=request.fields, **where)
    tokenize = partial(
        tokenize_documents,
        tokenizer_json=tokenizer.data,
        tokenizer_sha256=tokenizer.info.sha256,
        eos_id=tokenizer.info.eos_id,
        dtype=tokenizer.dtype,
        recipe=recipe,
    )
    itemsize = DTYPES[tokenizer.dtype]
    write = partial(write_pieces, out_root=run.out.uri, run=run.run, itemsize=itemsize, masked=recipe.masked, **where)
    with _quiet_ray_data(), ray.data.DataContext.current(_ordered_context()):
        rows = [chunk.to_row() for chunk in chunks]
        dataset: ray.data.Dataset = ray.data.from_items(rows, override_num_blocks=len(chunks))
        dataset = dataset.map_batches(read, batch_size=1, compute=compute)  # one chunk per call
        dataset = dataset.map_batches(tokenize, batch_size=None, compute=compute)
        dataset = dataset.map_batches(write, batch_size=None, compute=compute)
        yield from dataset.iter_batches(batch_size=None, batch_format="numpy")


def _store_shards(
    request: PrepareRequest,
    out: StorageBackend,
    plans: dict[str, SplitPlan],
    draft: TokenManifest,
    existing: TokenManifest | None,
    itemsize: int,
) -> tuple[TokenManifest, Counter[Stored]]:
    """Build every planned shard from its pieces in Ray Data tasks (checked against ``existing``); the manifest."""
    import ray.data

    committed = committed_objects(existing) if existing is not None else None
    stored_sizes = {info.key: info.size for info in out.list()} if existing is not None else {}
    rows = [shard.to_row(committed, stored_sizes) for plan in plans.values() for shard in plan.shards]
    outcomes: dict[str, ShardOutcome] = {}
    if rows:
        log.info("%s %d shard(s) from the pieces", "checking" if existing else "building", len(rows))
        compute = ray.data.TaskPoolStrategy(size=request.workers) if request.workers else None
        assemble = partial(
            assemble_shards,
            out_root=out.uri,
            itemsize=itemsize,
            masked=draft.loss_mask,
            endpoint_url=request.endpoint_url,
            region=request.region,
        )
        with _quiet_ray_data(), ray.data.DataContext.current(_ordered_context()):
            # A few blocks per worker: each task builds several shards, none waits long behind another.
            blocks = min(len(rows), 4 * (request.workers or os.cpu_count() or 1))
            dataset = ray.data.from_items(rows, override_num_blocks=blocks)
            for batch in dataset.map_batches(assemble, batch_size=1, compute=compute).iter_batches(
                batch_size=None, batch_format="numpy"
            ):
                for row in range(len(batch["key"])):
                    mask_sha256 = str(batch["mask_sha256"][row]) or None
                    outcome = ShardOutcome(str(batch["sha256"][row]), mask_sha256, Stored(batch["stored"][row]))
                    outcomes[str(batch["key"][row])] = outcome
    tally: Counter[Stored] = Counter(outcome.stored for outcome in outcomes.values())
    splits = {}
    for split, plan in plans.items():
        documents_sha256, stored = store_document_lengths(out, plan, committed, stored_sizes)
        if stored == Stored.DIFFERS:
            raise refuse_changed_inputs(out.uri, documents_key(split))
        splits[split] = split_index(plan, outcomes, documents_sha256, masked=draft.loss_mask)
    differs = sorted(key for key, outcome in outcomes.items() if outcome.stored == Stored.DIFFERS)
    if differs:
        raise refuse_changed_inputs(out.uri, differs[0])
    return replace(draft, splits=splits), tally


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
