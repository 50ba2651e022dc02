"""`setdlm data ...`: ``prepare`` (text: prepare.py; whole examples: prompt_answer.py) and ``inspect``.

Every command reports through `common.cli.run_command` (launch/cli.py wraps it): a mistake raises an
`Error` naming the option, printed as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from common.cli import ArgumentParser as CLIParser
from common.cli import run_command
from common.errors import StorageError, UsageError
from common.io import remove_temps
from common.storage import check_output_dir

from .config import PACKINGS
from .ingest import TXT_UNITS
from .prepare import prepare
from .prompt_answer import FORMATS, IM_START, OVERLONG, PLAIN_PROMPT, TEMPLATES, prepare_examples
from .shards import MANIFEST, PARTIAL

USAGE = """usage: setdlm data {prepare,inspect} ...

  prepare   tokenize and pack text into webdataset shards + manifest.json
  inspect   summarize a prepared directory (--verify checks every shard; --show N decodes samples),
            or what a run read: samples and tokens per source at its latest checkpoint
"""

PRESETS = {
    "owt": {"tokenizer": "gpt2", "seq_len": 1024, "packing": "wrapped", "val_docs": 100_000,
            "input": "Skylion007/openwebtext",
            "help": "OpenWebText: GPT-2 BPE, L=1024, documents joined with EOS and wrapped; val = the last "
                    "100,000 documents of the train split; --input defaults to Skylion007/openwebtext"},
    "lm1b": {"tokenizer": "bert-base-uncased", "seq_len": 128, "packing": "wrapped_bos_eos", "val_split": "test",
             "help": "LM1B: bert-base-uncased, L=128, sentences as [CLS] ... [SEP] concatenated and wrapped; "
                     "val = the dataset's own test split (--val-split test), or --val-input FILES for local "
                     "files; --input is required"},
}
DEFAULTS = {"tokenizer": "gpt2", "seq_len": 1024, "packing": "wrapped", "val_docs": 0, "val_split": None,
            "input": None}


def prepare_parser() -> argparse.ArgumentParser:
    p = CLIParser(prog="setdlm data prepare", description="Tokenize and pack text into webdataset shards + manifest.json.",
                  formatter_class=argparse.RawDescriptionHelpFormatter,
                  epilog="presets:\n" + "\n".join(f"  {k}: {v['help']}" for k, v in PRESETS.items()))
    p.add_argument("--input", help="Hugging Face dataset name, local parquet/json/jsonl/txt file(s) "
                   "or glob, a directory of them, a directory written by datasets' save_to_disk (--split picks a "
                   "DatasetDict's split), or builtin:pydoc_topics (required unless the preset names one)")
    p.add_argument("--output", "--out", required=True, help="directory for shards and manifest.json (local)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="field conventions (set tokenizer, L, packing, val split)")
    p.add_argument("--tokenizer", help=f"tokenizer name or directory (default {DEFAULTS['tokenizer']})")
    p.add_argument("--add-mask", action="store_true", help="append <|mask|> if the tokenizer has no mask token")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence L (default {DEFAULTS['seq_len']})")
    p.add_argument("--packing", choices=sorted(PACKINGS), help=f"default {DEFAULTS['packing']}")
    p.add_argument("--text-field", default="text", help="column holding the text (default: text)")
    p.add_argument("--split", default="train", help="dataset split to read as train (default: train)")
    p.add_argument("--name", help="Hugging Face dataset config name")
    p.add_argument("--txt-unit", default="line", choices=TXT_UNITS, help="what a document is in .txt files")
    p.add_argument("--val-docs", type=int, help="hold out the last N documents of the train split as val")
    p.add_argument("--val-split", help="dataset split to use as val (e.g. test)")
    p.add_argument("--val-input", help="val documents from another input (files, directory or dataset name; "
                   "its --val-split split if given)")
    p.add_argument("--samples-per-shard", type=int, default=4096, help="sequences per shard (default 4096)")
    p.add_argument("--num-proc", type=int, default=None, help="tokenizer processes (default: all CPUs)")
    p.add_argument("--docs-per-task", type=int, default=256, help="documents per tokenization task")
    p.add_argument("--max-docs", type=int, help="read only the first N documents of each split (tests, trials)")
    p.add_argument("--overwrite", action="store_true", help="replace shards prepared with other settings")
    add_example_args(p)  # --format prompt_answer | prompt_completion | chat | marker (data_pipeline/prompt_answer.py)
    return p


def add_example_args(p) -> None:
    g = p.add_argument_group("prompt/answer data (--format prompt_answer | prompt_completion | chat | marker; "
                             "docs/finetune.md)")
    g.add_argument("--format", default="text", choices=("text", *FORMATS),
                   help="text (default: documents packed for pretraining) or a prompt/answer format")
    g.add_argument("--prompt-field", default="prompt", help="prompt_answer: prompt field (GSM8K: question)")
    g.add_argument("--answer-field", default="answer", help="prompt_answer: answer field")
    g.add_argument("--messages-field", default="messages", help="chat: field holding the messages list")
    g.add_argument("--template", default="auto", choices=TEMPLATES, help="tokenizer: the tokenizer's own Jinja chat "
                   "template (or --chat-template); auto: chatml when the tokenizer has <|im_start|>/<|im_end|>, else "
                   "(chat) its chat template, else plain; the choice is printed")
    g.add_argument("--chat-template", metavar="FILE", help="--template tokenizer: this Jinja template instead of the "
                   "tokenizer's own (written into the output's tokenizer)")
    g.add_argument("--prompt-template", default=PLAIN_PROMPT, help="plain template: the context ({prompt} is "
                   "replaced); the answer follows after a space, then EOS")
    g.add_argument("--marker", default=IM_START, help="marker: the context ends --marker-offset tokens after the last one")
    g.add_argument("--marker-offset", type=int, default=2, help="marker: default 2 (<|im_start|> assistant \\n)")
    g.add_argument("--overlong", default="truncate", choices=OVERLONG,
                   help="examples longer than --seq-len: cut the answer's end (default) or leave them out")


# the numeric options and their smallest valid value (as a recipe key's range: data.seq_len >= 2)
BOUNDS = {"seq_len": 2, "samples_per_shard": 1, "num_proc": 1, "docs_per_task": 1, "max_docs": 1, "val_docs": 0,
          "marker_offset": 0}


def check_prepare_args(args) -> None:
    """Refuse a numeric option out of range and an unusable --out before any work, naming the flag."""
    for key, lo in BOUNDS.items():
        v = getattr(args, key)
        if v is not None and v < lo:
            raise UsageError(f"--{key.replace('_', '-')}: must be an integer >= {lo}, got {v}")
    check_output_dir(args.output, "--out")
    remove_temps(args.output)  # shards and manifests a killed run was writing (a live writer's file stays)
    for split in ("train", "val"):
        remove_temps(os.path.join(args.output, split))


def prepare_main(argv: list[str]) -> int:
    args = prepare_parser().parse_args(argv)
    check_prepare_args(args)
    fresh = not os.path.lexists(args.output)
    try:
        return _prepare(args)
    except StorageError:  # a full disk before any shard was kept: the directory this run made goes again
        if fresh and not os.path.exists(os.path.join(args.output, PARTIAL)):
            shutil.rmtree(args.output, ignore_errors=True)
        raise


def _prepare(args) -> int:
    if args.format != "text" or args.packing in ("padded", "packed"):
        if args.format == "text":
            raise UsageError(f"--packing {args.packing}: rows of whole examples need a prompt/answer --format "
                             f"({', '.join(FORMATS)})")
        if not args.input:
            raise UsageError("--input: required (a JSONL or Parquet file, a save_to_disk directory or a hub dataset)")
        return _prepare_examples(args)
    preset = {**DEFAULTS, **{k: v for k, v in PRESETS.get(args.preset, {}).items() if k != "help"}}
    for k in ("tokenizer", "seq_len", "packing", "val_docs", "val_split"):
        if getattr(args, k) is not None:
            preset[k] = getattr(args, k)
    if (args.val_split or args.val_input) and args.val_docs is None:
        preset["val_docs"] = 0
    if args.val_docs is not None and args.val_split is None:
        preset["val_split"] = None
    if args.val_input and args.val_split is None:
        preset["val_split"] = None
    source = args.input or preset.get("input")
    if not source:
        raise UsageError("--input: required" + (f" for preset {args.preset!r}" if args.preset else "")
                         + " (a dataset name, files, a directory or builtin:NAME)")
    m = prepare(source, args.output, tokenizer=preset["tokenizer"], seq_len=preset["seq_len"],
                packing=preset["packing"], text_field=args.text_field, split=args.split, name=args.name,
                txt_unit=args.txt_unit, val_docs=preset["val_docs"] or 0, val_split=preset["val_split"],
                val_input=args.val_input,
                samples_per_shard=args.samples_per_shard, num_proc=args.num_proc,
                docs_per_task=args.docs_per_task, max_docs=args.max_docs, add_mask=args.add_mask,
                overwrite=args.overwrite)
    for s, info in m["splits"].items():
        print(f"{s}: {info['num_shards']} shards, {info['num_samples']} sequences of {m['seq_len']} tokens "
              f"({info['num_documents']} documents)")
    print(f"wrote {os.path.join(args.output, MANIFEST)}")
    return 0


def _prepare_examples(args) -> int:
    """`--format prompt_answer | prompt_completion | chat | marker`: whole examples as rows (prompt_answer.py)."""
    if args.packing is None:
        args.packing = "padded"
    m = prepare_examples(args.input, args.output, fmt=args.format, tokenizer=args.tokenizer or "gpt2",
                         seq_len=args.seq_len or 1024, packing=args.packing, overlong=args.overlong,
                         template=args.template, val_docs=args.val_docs or 0, val_input=args.val_input,
                         val_split=args.val_split, split=args.split, name=args.name, chat_template=args.chat_template,
                         samples_per_shard=args.samples_per_shard, max_docs=args.max_docs, add_mask=args.add_mask,
                         overwrite=args.overwrite, prompt_field=args.prompt_field, answer_field=args.answer_field,
                         messages_field=args.messages_field, prompt_template=args.prompt_template,
                         marker=args.marker, marker_offset=args.marker_offset)
    for s, info in m["splits"].items():
        print(f"{s}: {info['num_shards']} shards, {info['num_samples']} rows of {m['seq_len']} tokens "
              f"({info['examples'].get('examples', 0)} of {info['num_documents']} examples used)")
    print(f"wrote {os.path.join(args.output, MANIFEST)}")
    return 0


def print_run_record(path: str, ckpt: str, meta: dict) -> int:
    """`setdlm data inspect RUN`: what the run read up to checkpoint `ckpt`, per source samples, tokens and
    epochs (the `data` record of its meta.json, which the checkpoint layer reads: launch/cli.py)."""
    import os

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
    p.add_argument("source", help="prepared directory (or fsspec URL), or a run / checkpoint directory (RUN:best, RUN:STEP)")
    p.add_argument("--verify", action="store_true", help="read every shard and check it against the manifest")
    p.add_argument("--show", type=int, default=0, metavar="N", help="decode the first N train sequences")
    args = p.parse_args(argv)
    import numpy as np

    from .shards import ShardSource, read_manifest
    from .sources import ShardError

    m = read_manifest(args.source)
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
        return prepare_main(rest)
    if cmd == "inspect":
        return inspect_main(rest)
    raise UsageError(f"unknown command {cmd!r}; valid: prepare, inspect (see setdlm data --help)")


if __name__ == "__main__":
    sys.exit(run_command("setdlm data", main, sys.argv[1:]))
