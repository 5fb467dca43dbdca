"""``meshpilot data prepare``: documents -> tokenizer -> EOS -> token shards + a manifest (the commit).

The corpus format is ``workers/spec/tokens.py``; this package writes it. Runs on the driver, except
the two functions Ray Data runs in its tasks (``reading.read_documents``, ``tokenize.tokenize_documents``).

    inputs.py     --input patterns -> the ordered input files and the byte ranges read as one task (driver)
    reading.py    one read chunk -> its documents, or an error row naming the bad line (Ray tasks)
    tokenize.py   the tokenizer file, its EOS token and shard dtype (driver); documents -> tokens (Ray tasks)
    writing.py    each split's stream cut into shards and uploaded; the manifest written last (driver)
    progress.py   the terminal view: input bytes, documents/s, tokens/s
    pipeline.py   prepare_corpus: the steps above in order, on one Ray Data dataset

Nothing here is imported by ``workers/`` or ``checkpointing/``; the modules Ray Data runs import only
``checkpointing.storage`` and ``workers.spec.tokens``.
"""
