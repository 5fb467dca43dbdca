"""``meshpilot ckpt ls|inspect|verify|export|import``: checkpoints on S3 or on disk, from a terminal.

Runs on the user's machine (driver side). S3 credentials come from the standard AWS chain
(``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance roles), never
from flags; ``--endpoint-url`` points at a non-AWS server (SeaweedFS, MinIO, ...).

    meshpilot ckpt ls s3://bucket/run --endpoint-url http://127.0.0.1:8333
    meshpilot ckpt inspect s3://bucket/run --step 20
    meshpilot ckpt verify s3://bucket/run --all
    meshpilot ckpt export s3://bucket/run --out hf-model/
    meshpilot ckpt export s3://bucket/lora-run --out adapter/ --format peft   # a LoRA run's adapters
    meshpilot ckpt import hf-model/ s3://bucket/new-run      # a Hugging Face directory as step 0
"""

from __future__ import annotations

import argparse
import json
import time

from checkpointing.catalog import list_committed, load_manifest
from checkpointing.errors import CheckpointNotFoundError, CorruptCheckpointError
from checkpointing.manifest import Manifest
from checkpointing.storage import StorageBackend, open_storage
from orchestrator.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ckpt",
        help="list, inspect, verify or export checkpoints",
        description="Checkpoints under a URI: s3://bucket/prefix, file:///dir or a directory.",
    )
    commands = parser.add_subparsers(dest="ckpt_command", metavar="ACTION")
    commands.required = True

    def add(name: str, help_text: str, handler, *, step: bool = True):
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("uri", help="s3://bucket/prefix, file:///dir or a directory")
        sub.add_argument(
            "--endpoint-url", default=None, help="S3 endpoint of a non-AWS server, e.g. http://127.0.0.1:8333"
        )
        sub.add_argument("--region", default=None, help="S3 region (default: the AWS chain's)")
        if step:
            sub.add_argument("--step", type=int, default=None, help="a committed step (default: the newest)")
        sub.set_defaults(handler=handler)
        return sub

    add("ls", "list committed checkpoints", _ls, step=False)
    inspect = add("inspect", "show one checkpoint's manifest: mesh, files, tensors, extra state", _inspect)
    inspect.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    verify = add("verify", "check every byte of a checkpoint against its checksums", _verify)
    verify.add_argument("--all", action="store_true", help="verify every committed step")
    export = add(
        "export", "write a Hugging Face model directory (names and config.json from the model family)", _export
    )
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument(
        "--format",
        default="hf",
        choices=("hf", "peft"),
        help="hf: the whole model (a LoRA run's adapters merged into its base); peft: a LoRA run's adapters as "
        "adapter_config.json + adapter_model.safetensors for peft.PeftModel.from_pretrained (default hf)",
    )
    export.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the exported weights (default: as stored)",
    )
    export.add_argument(
        "--max-shard-size-mb", type=float, default=2048.0, help="largest output file in MB (default 2048)"
    )
    _register_import(commands)


def _register_import(commands: argparse._SubParsersAction) -> None:
    text = "write a Hugging Face model directory's weights as committed step 0 of a new checkpoint URI"
    sub = commands.add_parser("import", help=text, description=text)
    sub.add_argument("hf_uri", metavar="HF_DIR_OR_URI", help="the model directory (config.json + *.safetensors)")
    sub.add_argument("uri", metavar="CKPT_URI", help="a checkpoint URI without committed steps")
    sub.add_argument("--endpoint-url", default=None, help="S3 endpoint of a non-AWS server (both URIs)")
    sub.add_argument("--region", default=None, help="S3 region (default: the AWS chain's)")
    sub.add_argument(
        "--family", default=None, help="model family (default: the one registered for config.json's architectures)"
    )
    sub.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the imported weights (default: as stored)",
    )
    sub.set_defaults(handler=_import)


def _storage(args: argparse.Namespace):
    return open_storage(args.uri, endpoint_url=args.endpoint_url, region=args.region)


def _ls(args: argparse.Namespace) -> int:
    storage = _storage(args)
    steps = list_committed(storage)
    if not steps:
        raise CheckpointNotFoundError(f"no committed checkpoint under {storage.uri}")
    print(f"{'step':>10}  {'committed at (UTC)':<20} {'size':>10}  {'files':>5}  mesh")
    for step in steps:
        try:
            manifest = load_manifest(storage, step)
        except CorruptCheckpointError as error:
            print(f"{step:>10}  CORRUPT: {error}")
            continue
        mesh = " ".join(f"{k}={v}" for k, v in manifest.mesh.items())
        print(
            f"{step:>10}  {_when(manifest.committed_at):<20} {_size(manifest.total_bytes):>10}  "
            f"{len(manifest.files):>5}  {mesh}"
        )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    storage = _storage(args)
    manifest = load_manifest(storage, args.step)
    if args.json:
        print(manifest.to_json().decode(), end="")
        return 0
    print(f"checkpoint  {storage.uri} step {manifest.step} (manifest version {manifest.version})")
    print(
        f"committed   {_when(manifest.committed_at)} UTC; upload {manifest.upload_s:.2f} s, "
        f"loop stall {manifest.stall_s * 1000:.1f} ms (slowest rank)"
    )
    print(f"mesh        {json.dumps(manifest.mesh)}  world size {manifest.world_size}")
    print(f"model       {json.dumps(manifest.model)}")
    print(f"config      {manifest.config_hash}")
    print(f"extra       {json.dumps(manifest.extra)[:2000]}")
    print(f"files       {len(manifest.files)}, {_size(manifest.total_bytes)}")
    for entry in manifest.files:
        print(f"  rank {entry.rank:>5}  {_size(entry.bytes):>10}  {entry.key}")
    print(f"tensors     {len(manifest.tensors)}")
    for fqn, index in sorted(manifest.tensors.items()):
        print(f"  {fqn:<60} {index.dtype:<9} {str(list(index.shape)):<16} {len(index.chunks)} chunk(s)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from checkpointing.verify import verify_checkpoint

    storage = _storage(args)
    steps = list_committed(storage) if args.all else [args.step]
    if args.all and not steps:
        raise CheckpointNotFoundError(f"no committed checkpoint under {storage.uri}")
    failures = []
    for step in steps:
        started = time.perf_counter()
        try:
            result = verify_checkpoint(storage, step)
        except CorruptCheckpointError as error:
            failures.append(error)
            print(f"CORRUPT  {error}")
            continue
        print(
            f"OK       step {result.step}: {result.files} files, {_size(result.bytes)} verified "
            f"in {time.perf_counter() - started:.1f} s"
        )
    if failures:
        raise CorruptCheckpointError(
            f"{len(failures)} corrupt checkpoint(s) under {storage.uri}; the first: shard {failures[0].key}",
            key=failures[0].key,
        )
    return 0


def _export(args: argparse.Namespace) -> int:
    from workers.adapter_export import adapter_settings, export_adapter  # torch: only once an export runs
    from workers.hf_transfer import export_family

    storage = _storage(args)
    manifest = load_manifest(storage, args.step)
    where = f"{storage.uri} step {manifest.step}"
    if args.format == "peft":
        if args.dtype is not None:
            raise UserError("--dtype applies to --format hf; PEFT adapters are written as trained")
        adapter_settings(manifest, where)
        out = export_adapter(storage, args.out, step=manifest.step)
        print(
            f"exported the LoRA adapters of {where} to {out} "
            "(load with peft.PeftModel.from_pretrained(base_model, DIR) on the base the run started from)"
        )
        return 0
    max_shard_bytes = int(args.max_shard_size_mb * (1 << 20))
    if manifest.lora is not None:
        return _export_merged(args, storage, manifest, max_shard_bytes)
    out, naming = export_family(
        storage, args.out, step=manifest.step, dtype=args.dtype, max_shard_bytes=max_shard_bytes
    )
    print(f"exported {where} ({naming.family_name} family) to {out} {_LOAD_HINT}")
    return 0


_LOAD_HINT = "(load with transformers.AutoModelForCausalLM.from_pretrained)"


def _export_merged(args: argparse.Namespace, storage: StorageBackend, manifest: Manifest, max_shard_bytes: int) -> int:
    """A LoRA checkpoint as one model: its base, read from where the run read it, with the adapters merged."""
    from orchestrator.model_source import released_weights_sha256
    from workers.adapter_export import RANDOM_BASE_PREFIX, export_merged

    where = f"{storage.uri} step {manifest.step}"
    base = manifest.lora_base or {}
    source = str(base.get("source", ""))
    if not source or source.startswith(RANDOM_BASE_PREFIX):
        raise UserError(
            f"{where} holds LoRA adapters trained beside a seeded random base (no model.init_from), so there are "
            "no released weights to merge them into; export them with --format peft"
        )
    base_storage = open_storage(source, endpoint_url=args.endpoint_url, region=args.region)
    try:
        if released_weights_sha256(base_storage) != base.get("sha256"):
            raise UserError(
                f"the base model at {source} is not the one {where} was trained beside (its fingerprint differs): "
                "merging needs those very weights; restore them there, or export the adapters with --format peft"
            )
        out, naming = export_merged(
            storage, base_storage, args.out, step=manifest.step, dtype=args.dtype, max_shard_bytes=max_shard_bytes
        )
    finally:
        base_storage.close()
    print(f"exported {where} ({naming.family_name} family, LoRA merged into {source}) to {out} {_LOAD_HINT}")
    return 0


def _import(args: argparse.Namespace) -> int:
    from checkpointing.hf_format import open_hf_checkpoint
    from checkpointing.hf_import import import_hf
    from workers.hf_transfer import import_plan  # torch: only once an import runs

    source = open_storage(args.hf_uri, endpoint_url=args.endpoint_url, region=args.region)
    dest = _storage(args)
    checkpoint = open_hf_checkpoint(source)
    plan = import_plan(checkpoint.config, set(checkpoint.tensors), f"{source.uri}/config.json", family=args.family)
    manifest = import_hf(
        source,
        dest,
        names=plan.names,
        model=plan.spec.to_dict(),
        dtype=args.dtype,
        shapes=plan.shapes,
        checkpoint=checkpoint,
    )
    print(
        f"imported {source.uri} ({plan.family} family, {len(manifest.tensors)} tensors, "
        f"{_size(manifest.total_bytes)}) as step 0 of {dest.uri}; weights only: a job resuming from it "
        "starts its optimizer fresh"
    )
    return 0


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(timestamp))


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"
