"""Asynchronous sharded safetensors checkpoints on S3 or disk, restorable into any mesh.

Rank side (imports torch):
    ``writer.CheckpointWriter``  stage to host, return, upload in the background, report
    ``reader.restore``           fill this rank's tensors from any writer mesh (DCP planner)
    ``export.export_hf``         a Hugging Face LlamaForCausalLM directory

Driver side (torch-free):
    ``commit.CommitCoordinator`` commit a step once every rank reported (put-if-absent)
    ``catalog``                  list_committed, latest_committed, load_manifest, choose_restore
    ``retention``, ``verify``, ``storage.open_storage``, ``local_s3.LocalS3Server``

Plain values shared by both: ``spec`` (layout, reports), ``manifest`` (versioned JSON), ``errors``.
"""
