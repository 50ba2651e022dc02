"""Checkpoints: atomic, resumable, readable under any parallel layout.

    rundir.py       the run directory's files: checkpoint tags, the `latest` pointer (with its
                    fallback to the newest complete checkpoint), COMPLETE markers, meta.json, the
                    tokenizer's location and sha256 check, the `best` record and the
                    RUN:best / RUN:latest / RUN:STEP names. Everything that reads a run uses it.
    best.py         train.keep_best: the best validation checkpoint, kept outside keep_last
    rng.py          the per-rank random-number state kept in a checkpoint
    save.py         saving from every rank (atomic publish, disk-full handling) and pruning
    resume.py       continuing a run: the same layout through DeepSpeed, another one from consolidated.pt
    relayout.py     a full (TP=1) state into this rank's shard of an engine of any layout
    shards.py       reading and merging the shard files of one checkpoint
    consolidate.py  `setdlm convert consolidate`: the merged state, written once
    inference.py    `load_model`: a trained model in this process (no process group)

Every file is read with `pretrain/safe_load.py` (weights only: nothing in a checkpoint can run code),
and every problem with a checkpoint is a `CheckpointError` naming the file.
"""
