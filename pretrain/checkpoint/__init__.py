"""Checkpoints: sharded, written in the background, readable under any parallel layout.

    rundir.py       the run directory's files: checkpoint tags, the `latest` pointer (with its
                    fallback to the newest complete checkpoint), COMPLETE markers, meta.json, how a
                    checkpoint is stored, the tokenizer's location and sha256 check, the `best` record
                    and the RUN:best / RUN:latest / RUN:STEP names. Everything that reads a run uses it.
    distcp.py       format 2 through torch.distributed.checkpoint: chunks of global tensors, the
                    planners, the index read through an allow-list, whole-tensor reads
    train_state.py  what a rank owns of weights, fp32 masters, Adam moments and EMA, as chunks
    writer.py       a save: snapshot in the step loop, the write in the background, the publish
    save.py         what saves share: temporary names, a failed save undone, the space check, pruning
    best.py         train.keep_best: the best validation checkpoint, kept outside keep_last
    rng.py          the per-rank random-number state kept in a checkpoint
    resume.py       continuing a run under any layout (format 2); format 1 through DeepSpeed or merged
    relayout.py     a full (TP=1) state into this rank's shard of an engine of any layout
    shards.py       reading and merging the DeepSpeed files of a format-1 checkpoint
    consolidate.py  `setdlm convert consolidate`: the merged state, written once (a one-file export)
    versions.py     the format version, its migrations and the weight renames between versions
    inference.py    `load_model`: a trained model in this process (no process group)

Every file is read as data: whole files with `pretrain/safe_load.py` (weights only: nothing in a
checkpoint can run code), format-2 tensors by DCP with weights_only=True and its index through an
allow-list; every problem with a checkpoint is a `CheckpointError` naming the file.
"""
