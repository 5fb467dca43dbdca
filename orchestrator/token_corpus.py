"""``data.source: tokens`` checked against its corpus on the driver, before any worker starts.

Runs on the driver, inside ``load_config`` (called from ``config_checks.validate``). Reads the
corpus manifest only, never a shard: where the corpus lies (``data.uri``: a directory, tried from
the current directory and then the config file's, or an ``s3://`` prefix read with the
checkpoint section's endpoint and region and the standard AWS credentials), whether a
manifest is there, whether the model's vocabulary holds the corpus tokenizer's, whether
``training.seq_len`` fits in the train split, and, when ``data.tokenizer`` names one, whether
the corpus was prepared with that tokenizer. It also settles ``data.packing`` (unset: the corpus
format's default) and whether the corpus can be packed that way on this layout. Every problem is
one sentence naming the key.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from checkpointing.errors import CheckpointError
from checkpointing.storage import StorageBackend, open_storage
from workers.spec.tokens import (
    MANIFEST_KEY,
    Packing,
    TokenCorpusError,
    TokenManifest,
    parse_token_manifest,
    window_count,
)
from workers.spec.train import TokenCorpusSource

if TYPE_CHECKING:
    from orchestrator.config import JobConfig
    from workers.spec import ModelSpec

# How a corpus is made, as the fix of a missing one (the flags of `meshpilot data prepare`).
PREPARE_HINT = "meshpilot data prepare --input FILES --tokenizer tokenizer.json --out"


def token_corpus_source(config: JobConfig) -> TokenCorpusSource | None:
    """Where the ranks read the corpus: a local directory made absolute (ranks share the disk)."""
    if config.data.source != "tokens" or config.data.uri is None:
        return None
    packing = Packing(config.data.packing or Packing.WINDOWS)  # set from the manifest by the checks
    return TokenCorpusSource(corpus_uri(config), config.checkpoint.endpoint_url, config.checkpoint.region, packing)


def corpus_uri(config: JobConfig) -> str:
    """``data.uri`` as storage opens it: a URI as given, a local path resolved like ``data.path``."""
    uri = config.data.uri or ""
    if "://" in uri:
        return uri
    return str(_local_path(uri, config.source_dir) or Path(uri).absolute())


def token_corpus_problems(config: JobConfig, model: ModelSpec) -> list[str]:
    """The corpus against the job; sets ``config.data.manifest_sha256`` (the config hash reads it)."""
    uri = config.data.uri
    if not uri:
        return [
            "data.source=tokens needs data.uri: the directory or s3:// prefix of a corpus written by "
            f"{PREPARE_HINT} URI"
        ]
    if "://" in uri and not uri.startswith(("s3://", "file://")):
        scheme = uri.split("://", 1)[0]
        return [f"data.uri={uri!r}: scheme {scheme!r} is not supported; use s3://, file:// or a directory"]
    try:
        raw = _read_manifest_bytes(config)
        manifest = parse_token_manifest(raw, f"data.uri={uri!r}")
    except (TokenCorpusError, CheckpointError, OSError) as error:
        return [str(error)]
    config.data.manifest_sha256 = hashlib.sha256(raw).hexdigest()
    if config.data.packing is None:
        config.data.packing = str(Packing.default_for(manifest.corpus_format))
    problems = _shape_problems(config, model, manifest) + _packing_problems(config, manifest)
    if config.data.tokenizer is not None:
        problems.extend(_tokenizer_problems(config, manifest))
    return problems


def _read_manifest_bytes(config: JobConfig) -> bytes:
    uri = config.data.uri
    storage = _open(corpus_uri(config), config)
    try:
        if not storage.exists(MANIFEST_KEY):
            raise TokenCorpusError(
                f"data.uri={uri!r}: no token corpus there ({MANIFEST_KEY} is missing); prepare it with "
                f"{PREPARE_HINT} {uri}"
            )
        return storage.get(MANIFEST_KEY)
    except CheckpointError as error:  # unreachable storage, refused credentials: the key, then why
        raise TokenCorpusError(f"data.uri={uri!r}: {error}") from None
    finally:
        storage.close()


def _shape_problems(config: JobConfig, model: ModelSpec, manifest: TokenManifest) -> list[str]:
    uri, seq_len = config.data.uri, config.training.seq_len
    problems = []
    vocab = manifest.tokenizer.vocab_size
    if vocab > model.vocab_size:
        problems.append(
            f"model.vocab_size={model.vocab_size} is smaller than the vocabulary of the tokenizer the corpus at "
            f"data.uri={uri!r} was prepared with ({vocab} tokens); set model.vocab_size to at least {vocab}"
        )
    train_tokens = manifest.splits["train"].tokens
    if config.data.packing == Packing.WINDOWS and window_count(train_tokens, seq_len) < 1:
        problems.append(
            f"training.seq_len={seq_len} is longer than the corpus at data.uri={uri!r}: its train split holds "
            f"{train_tokens} tokens, and one sample takes seq_len + 1 = {seq_len + 1}; lower training.seq_len or "
            "prepare more documents"
        )
    return problems


def _packing_problems(config: JobConfig, manifest: TokenManifest) -> list[str]:
    """``data.packing: documents`` needs the corpus's document lengths (version 2)."""
    if config.data.packing == Packing.DOCUMENTS and not manifest.has_documents:
        return [
            f"data.packing=documents: the corpus at data.uri={config.data.uri!r} stores no document lengths (a "
            f"version-{manifest.version} corpus); prepare it again with meshpilot data prepare, or set "
            "data.packing=windows"
        ]
    return []


def _tokenizer_problems(config: JobConfig, manifest: TokenManifest) -> list[str]:
    tokenizer, uri = config.data.tokenizer or "", config.data.uri
    try:
        digest = hashlib.sha256(_read_tokenizer(config)).hexdigest()
    except (CheckpointError, OSError) as error:
        return [f"data.tokenizer={tokenizer!r}: {error}"]
    if digest != manifest.tokenizer.sha256:
        return [
            f"data.uri={uri!r} is a corpus from another tokenizer than the configured one: it was prepared with a "
            f"tokenizer of sha256 {manifest.tokenizer.sha256[:16]}..., data.tokenizer={tokenizer!r} has sha256 "
            f"{digest[:16]}...; prepare the corpus again with {tokenizer}, or point data.tokenizer at the "
            "tokenizer.json it was prepared with"
        ]
    return []


def _read_tokenizer(config: JobConfig) -> bytes:
    """The configured tokenizer.json's bytes: an ``s3://`` object, or a file tried like ``data.path``."""
    tokenizer = config.data.tokenizer or ""
    if tokenizer.startswith("s3://"):
        prefix, _, name = tokenizer.rpartition("/")
        storage = _open(prefix, config)
        try:
            if not storage.exists(name):
                raise OSError("no such object; give the tokenizer.json the corpus was prepared with")
            return storage.get(name)
        finally:
            storage.close()
    path = _local_path(tokenizer, config.source_dir)
    if path is None or not path.is_file():
        raise OSError("no such file; give the tokenizer.json the corpus was prepared with")
    return path.read_bytes()


def _open(uri: str, config: JobConfig) -> StorageBackend:
    """Storage for ``uri``; ``s3://`` uses the checkpoint section's endpoint and region."""
    return open_storage(uri, endpoint_url=config.checkpoint.endpoint_url, region=config.checkpoint.region)


def _local_path(where: str, source_dir: str | None) -> Path | None:
    """A local path tried from the current directory, then from the config file's directory."""
    if where.startswith("file://"):
        return Path(where[len("file://") :])
    candidates = [Path(where)]
    if source_dir and not Path(where).is_absolute():
        candidates.append(Path(source_dir) / where)
    for candidate in candidates:
        if candidate.exists():
            return candidate.resolve()
    return None
