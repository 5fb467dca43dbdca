"""``meshpilot data prepare``: documents -> tokens (+ loss masks) -> token shards + a manifest (the commit).

The corpus format is ``workers/spec/tokens.py``; this package writes it. Runs on the driver, except
the functions Ray Data runs in its tasks (``reading.read_documents``, ``tokenize.tokenize_documents``
with ``chat``, ``pieces.write_pieces`` and ``pieces.assemble_shards``).

    inputs.py     --input patterns -> the ordered input files and the byte ranges read as one task (driver)
    reading.py    one read chunk -> its documents (text, messages, prompt + completion), or an error row (Ray tasks)
    tokenize.py   the tokenizer file, its EOS, dtype and chat template (driver); documents -> tokens (Ray tasks)
    chat.py       conversations and prompt/completion pairs -> tokens and the loss mask of what trains (Ray tasks)
    pieces.py     tokenized batches -> pieces in --out; planned shards -> built from pieces and stored (Ray tasks)
    writing.py    each split planned into shards (piece ranges); documents.bin; the manifest written last (driver)
    inspect_corpus.py  ``meshpilot data inspect``: the summary, one document read by byte ranges (driver)
    progress.py   the terminal view: input bytes, documents/s, tokens/s
    pipeline.py   prepare_corpus: the steps above in order, on two Ray Data datasets (documents, then shards)

Nothing here is imported by ``workers/`` or ``checkpointing/``; the modules Ray Data runs import only
``checkpointing.storage``, ``workers.spec.tokens`` and (chat) ``transformers``' template renderer.
"""
