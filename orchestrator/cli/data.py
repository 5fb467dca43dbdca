"""``meshpilot data prepare|inspect``: tokenize a corpus on Ray Data into shards + a manifest; look at one (driver).

    meshpilot data prepare --input 'corpus/*.jsonl' --tokenizer models/llama/ --out s3://bucket/corpus \\
        --endpoint-url http://127.0.0.1:8333
    meshpilot data prepare --format chat --input 'chats/*.jsonl' --tokenizer models/llama-instruct/ --out chat-tokens
    meshpilot data inspect chat-tokens --document 3 --tokenizer models/llama-instruct/
    meshpilot train cfg.yaml --set data.source=tokens --set data.uri=s3://bucket/corpus

A layer over ``orchestrator.data_prep.pipeline.prepare_corpus``: flags in, a summary out. S3
credentials come from the standard AWS chain, never from flags.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from orchestrator.data_prep.chat import TrainOn
from orchestrator.data_prep.inputs import DEFAULT_CHUNK_BYTES
from workers.spec.tokens import SPLITS, CorpusFormat

if TYPE_CHECKING:
    from orchestrator.data_prep.pipeline import PrepareResult


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("data", help="prepare training data", description="Prepare training data.")
    commands = parser.add_subparsers(dest="data_command", metavar="ACTION")
    commands.required = True
    text = "tokenize documents into token shards and a manifest (the corpus data.source: tokens trains on)"
    prepare = commands.add_parser("prepare", help=text, description=text)
    prepare.add_argument(
        "--input",
        nargs="+",
        required=True,
        dest="inputs",
        metavar="FILE_OR_GLOB",
        help="local or s3:// files or globs: .txt (one document per file), .jsonl, .parquet",
    )
    prepare.add_argument(
        "--format",
        dest="corpus_format",
        choices=[str(value) for value in CorpusFormat],
        default=str(CorpusFormat.TEXT),
        help="text: documents; chat: message lists rendered with the tokenizer's chat template; "
        "prompt-completion: a prompt and its completion (default text)",
    )
    prepare.add_argument("--text-field", default="text", help="the .jsonl field / .parquet column of the text")
    prepare.add_argument(
        "--messages-field", default="messages", help="--format chat: the field of the message list (default messages)"
    )
    prepare.add_argument(
        "--prompt-field", default="prompt", help="--format prompt-completion: the prompt's field (default prompt)"
    )
    prepare.add_argument(
        "--completion-field",
        default="completion",
        help="--format prompt-completion: the completion's field (default completion)",
    )
    prepare.add_argument(
        "--train-on",
        choices=[str(value) for value in TrainOn],
        default=None,
        help="the tokens that train: assistant (chat's default: assistant turns and their end-of-turn tokens), "
        "completion (prompt-completion's default: the completion and its EOS), or all",
    )
    prepare.add_argument("--tokenizer", required=True, help="a tokenizer.json, or a model directory holding one")
    prepare.add_argument("--eos-token", default=None, help="the end-of-text token, when the tokenizer names none")
    prepare.add_argument("--out", required=True, help="a directory or s3://bucket/prefix for the corpus")
    prepare.add_argument(
        "--validation-fraction", type=float, default=0.01, help="share of documents held out (default 0.01)"
    )
    prepare.add_argument("--split-seed", type=int, default=0, help="seed of the document split (default 0)")
    prepare.add_argument("--shard-mb", type=float, default=128.0, help="shard size in MiB (default 128)")
    prepare.add_argument(
        "--address", default=None, help="an existing Ray cluster (default: RAY_ADDRESS, else an embedded local cluster)"
    )
    prepare.add_argument("--endpoint-url", default=None, help="S3 endpoint of a non-AWS server (inputs and --out)")
    prepare.add_argument("--region", default=None, help="S3 region (default: the AWS chain's)")
    prepare.add_argument(
        "--workers", type=int, default=None, help="concurrent read+tokenize tasks (default: one per cluster CPU)"
    )
    prepare.add_argument(
        "--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / 2**20, help="input read per task, in MiB (default 4)"
    )
    prepare.add_argument("--plain", action="store_true", help="plain progress lines instead of a bar")
    prepare.set_defaults(handler=handle)
    _register_inspect(commands)


def _register_inspect(commands: argparse._SubParsersAction) -> None:
    text = "a corpus's summary, and one document with its untrained tokens marked"
    inspect = commands.add_parser("inspect", help=text, description=text)
    inspect.add_argument("uri", metavar="URI", help="the corpus: the --out of meshpilot data prepare")
    inspect.add_argument("--document", type=int, default=0, help="the document to show, from 0 (default 0)")
    inspect.add_argument("--split", choices=list(SPLITS), default="train", help="its split (default train)")
    inspect.add_argument("--tokenizer", default=None, help="the corpus's tokenizer.json, to decode (else ids)")
    inspect.add_argument(
        "--json", action="store_true", help='print {"tokens": [...], "loss_mask": [...]} of the document only'
    )
    inspect.add_argument("--plain", action="store_true", help="untrained spans between [[ ]] even on a terminal")
    inspect.add_argument("--endpoint-url", default=None, help="S3 endpoint of a non-AWS server")
    inspect.add_argument("--region", default=None, help="S3 region (default: the AWS chain's)")
    inspect.set_defaults(handler=handle_inspect)


def handle(args: argparse.Namespace) -> int:
    # Imported here: Ray Data takes a second or two to import, and only this command needs it.
    from orchestrator.data_prep.pipeline import PrepareRequest, prepare_corpus
    from orchestrator.data_prep.progress import PrepareProgress
    from orchestrator.errors import UserError

    if not args.chunk_mb > 0:
        raise UserError(f"--chunk-mb {args.chunk_mb}: give a positive size in MiB, e.g. 4")
    request = PrepareRequest(
        inputs=tuple(args.inputs),
        tokenizer=args.tokenizer,
        out=args.out,
        text_field=args.text_field,
        corpus_format=CorpusFormat(args.corpus_format),
        messages_field=args.messages_field,
        prompt_field=args.prompt_field,
        completion_field=args.completion_field,
        train_on=TrainOn(args.train_on) if args.train_on else None,
        eos_token=args.eos_token,
        validation_fraction=args.validation_fraction,
        split_seed=args.split_seed,
        shard_mb=args.shard_mb,
        address=args.address,
        endpoint_url=args.endpoint_url,
        region=args.region,
        workers=args.workers,
        chunk_bytes=max(1, int(args.chunk_mb * 2**20)),
    )
    result = prepare_corpus(request, progress=PrepareProgress(force_plain=args.plain))
    _summarise(result)
    return 0


def handle_inspect(args: argparse.Namespace) -> int:
    from orchestrator.data_prep import inspect_corpus

    where = {"endpoint_url": args.endpoint_url, "region": args.region}
    storage, manifest = inspect_corpus.open_corpus(args.uri, **where)
    document = inspect_corpus.read_document(storage, manifest, args.split, args.document)
    if args.json:
        print(json.dumps({"tokens": list(document.tokens), "loss_mask": list(document.loss_mask)}))
        return 0
    decoder = inspect_corpus.load_decoder(args.tokenizer, manifest, **where) if args.tokenizer else None
    console = Console(soft_wrap=True)
    console.print(f"{storage.uri}", markup=False)
    for line in inspect_corpus.summary(manifest):
        console.print(f"  {line}", markup=False)
    console.print(
        f"{args.split} document {document.number}: {len(document.tokens):,} tokens from token {document.start:,}, "
        f"{document.trained:,} trained; untrained spans "
        + (
            "dim"
            if console.is_terminal and not args.plain
            else f"{inspect_corpus.UNTRAINED_OPEN} ... {inspect_corpus.UNTRAINED_CLOSE}"
        ),
        markup=False,
    )
    runs = inspect_corpus.marked_runs(document, decoder)
    separator = "" if decoder is not None else " "
    if console.is_terminal and not args.plain:
        console.print(Text(separator).join(Text(text, style="" if trained else "dim") for trained, text in runs))
    else:
        console.print(inspect_corpus.plain_text(runs, separator=separator), markup=False, highlight=False)
    return 0


def _summarise(result: PrepareResult) -> None:
    console = Console(soft_wrap=True)  # paths to copy: never wrapped
    manifest = result.manifest
    info = manifest.tokenizer
    if result.committed:
        verb = "prepared"
    elif result.shards_repaired:
        verb = f"already prepared (identical; {result.shards_repaired} missing shard(s) written again)"
    else:
        verb = "already prepared (identical, nothing rewritten)"
    console.print(
        f"{verb}: {result.uri}  {result.documents:,} documents, {result.tokens:,} tokens "
        f"({manifest.dtype}, vocab {info.vocab_size:,}, eos {info.eos_token!r} = {info.eos_id})",
        markup=False,
    )
    mask = "loss mask stored" if manifest.loss_mask else "every token trains"
    console.print(f"  format {manifest.corpus_format}, {mask}", markup=False)
    for name, split in manifest.splits.items():
        console.print(
            f"  {name:<10} {split.documents:>12,} documents {split.tokens:>14,} tokens "
            f"{split.trained:>14,} trained {len(split.shards):>6} shard(s)"
        )
    seconds = max(result.seconds, 1e-9)
    rates = f"{result.documents / seconds:,.0f} documents/s, {result.tokens / seconds:,.0f} tokens/s"
    console.print(f"  {result.seconds:.1f} s: {rates}")
