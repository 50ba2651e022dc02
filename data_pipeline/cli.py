"""`setdlm data ...`: ``prepare`` (see prepare.py) and ``inspect``."""
from __future__ import annotations

import sys

from common.cli import ArgumentParser as CLIParser

USAGE = """usage: setdlm data {prepare,inspect} ...

  prepare   tokenize and pack text into webdataset shards + manifest.json
  inspect   summarize a prepared directory (--verify checks every shard; --show N decodes samples),
            or what a run read: samples and tokens per source at its latest checkpoint
"""


def _checkpoint_of(path: str):
    """The checkpoint directory `path` names (a run directory: its latest; a checkpoint), or None."""
    import os

    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    latest = os.path.join(path, "checkpoints", "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(path, "checkpoints", f.read().strip())
    return None


def inspect_run(path: str, ckpt: str) -> int:
    """Print what the run read up to checkpoint `ckpt`: per source samples, tokens, epochs (meta.json `data`)."""
    import json
    import os

    from common.errors import InputFileError

    meta_file = os.path.join(ckpt, "meta.json")
    try:
        with open(meta_file) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise InputFileError(f"{meta_file}: cannot read the checkpoint's metadata ({e})") from None
    rec = meta.get("data") if isinstance(meta, dict) else None
    print(f"{path}: checkpoint {os.path.basename(os.path.normpath(ckpt))}, step {meta.get('step')}"
          + (f", global position {rec['position']:,}" if isinstance(rec, dict) else ""))
    if not isinstance(rec, dict) or not isinstance(rec.get("sources"), dict):
        print("  no per-source record (the checkpoint predates it); step x train.global_batch samples were read")
        return 0
    rows = [(n, f"{r.get('weight', 1.0):g}", f"{r.get('share', 1.0):.4f}", f"{r['samples']:,}", f"{r['tokens']:,}",
             str(r.get("epochs", 0)), str(r.get("source"))) for n, r in rec["sources"].items()]
    head = ("source", "weight", "share", "samples", "tokens", "epochs", "directory")
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    for row in (head, *rows):
        print(("  " + "  ".join(x.ljust(w) if i in (0, 6) else x.rjust(w)
                                for i, (x, w) in enumerate(zip(row, widths)))).rstrip())
    return 0


def inspect_main(argv: list[str]) -> int:
    p = CLIParser(prog="setdlm data inspect")
    p.add_argument("source", help="prepared directory (or fsspec URL), or a run / checkpoint directory")
    p.add_argument("--verify", action="store_true", help="read every shard and check it against the manifest")
    p.add_argument("--show", type=int, default=0, metavar="N", help="decode the first N train sequences")
    args = p.parse_args(argv)
    ckpt = _checkpoint_of(args.source)
    if ckpt is not None:
        return inspect_run(args.source, ckpt)
    import numpy as np

    from .shards import ShardSource, read_manifest
    from .sources import ShardError

    try:
        m = read_manifest(args.source)
    except ValueError as e:
        print(f"setdlm data inspect: error: {e}", file=sys.stderr)
        return 2
    t = m["tokenizer"]
    print(f"{args.source}: seq_len {m['seq_len']}, packing {m['packing']}, dtype {m['dtype']}, "
          f"tokenizer {t['name']} (vocab {t['vocab_size']}, mask {t['mask_id']}, sha256 {t['sha256'][:12]}...)")
    for split, info in m["splits"].items():
        src = m.get("sources", {}).get(split, {}).get("description", "?")
        print(f"  {split}: {info['num_shards']} shards, {info['num_samples']:,} sequences, {info['num_tokens']:,} "
              f"tokens, {info['num_documents']:,} documents  <- {src}")
    source = ShardSource(args.source, m, verify=True)
    bad = 0
    if args.verify:
        for split in m["splits"]:
            for u in range(len(source.counts(split))):
                try:
                    source.read_unit(split, u)
                except ShardError as e:
                    bad += 1
                    print(f"  BAD {e}")
        print(f"verified: {'all shards good' if not bad else f'{bad} bad shards'}")
    if args.show:
        from .shards import join_url
        from .tokenizers import load_tokenizer

        tok = load_tokenizer(join_url(args.source, "tokenizer"))
        rows = np.concatenate([source.read_unit("train", u) for u in range(len(source.counts("train")))
                               if u * m["samples_per_shard"] < args.show])[: args.show]
        for i, r in enumerate(rows):
            if r.ndim == 2:  # prompt/answer rows: ids, context mask, valid mask
                ctx, ans = r[0][r[1] != 0], r[0][(r[2] != 0) & (r[1] == 0)]
                print(f"--- train sequence {i}\n[context] {tok.decode(ctx)}\n[answer] {tok.decode(ans)}")
                continue
            print(f"--- train sequence {i}\n{tok.decode(r)}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "prepare":
        from .prepare import main as prepare_main

        return prepare_main(rest)
    if cmd == "inspect":
        return inspect_main(rest)
    print(f"setdlm data: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
