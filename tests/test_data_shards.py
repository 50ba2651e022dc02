"""Prepared webdataset shards: round trip with real tokenizers, resumable prepare, streaming loader
(2 ranks x 2 workers exactly once, seeded order, resume), faults and mismatches."""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from data_pipeline import prepare as prep  # noqa: E402
from data_pipeline import shard_writer  # noqa: E402
from data_pipeline.config import DataConfig  # noqa: E402
from data_pipeline.corpus import builtin_text  # noqa: E402
from data_pipeline.loader import build_loader  # noqa: E402
from data_pipeline.shards import ShardSource, read_manifest  # noqa: E402
from data_pipeline.sources import ShardError  # noqa: E402
from data_pipeline.tokenizers import load_tokenizer  # noqa: E402

QUIET = {"log": lambda msg: None}


def cli_main(argv: list) -> int:
    """`setdlm data ARGV` as the command line runs it (one-line errors, exit status 2)."""
    from launch.cli import main

    return main(["data", *map(str, argv)])


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def docs():
    return builtin_text("pydoc_topics")[:30]


@pytest.fixture(scope="module")
def owt_dir(tmp_path_factory, docs):
    """OWT-style shards (GPT-2, wrapped, val = last 3 documents) from a jsonl file, 2 processes."""
    root = tmp_path_factory.mktemp("owt")
    src = root / "docs.jsonl"
    with open(src, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d}) + "\n")
    out = root / "shards"
    prep.prepare(str(src), str(out), tokenizer="gpt2", seq_len=64, packing="wrapped", val_docs=3,
                 samples_per_shard=40, num_proc=2, docs_per_task=4, **QUIET)
    return out


def _rows(out, split):
    src = ShardSource(str(out), read_manifest(str(out)), verify=True)
    return np.concatenate([src.read_unit(split, u) for u in range(len(src.counts(split)))])


def test_owt_round_trip(owt_dir, docs, gpt2):
    m = read_manifest(str(owt_dir))
    assert m["tokenizer"]["sha256"] == gpt2.sha256 and m["seq_len"] == 64 and m["dtype"] == "uint16"
    for split, part in (("train", docs[:-3]), ("val", docs[-3:])):
        flat = _rows(owt_dir, split).reshape(-1).tolist()
        expect = [t for d in part for t in gpt2.encode(d) + [gpt2.eos_id]]
        n = len(expect) // 64 * 64
        assert flat == expect[:n] and m["splits"][split]["num_samples"] * 64 == n
        assert m["splits"][split]["dropped_tail_tokens"] == len(expect) - n
        # EOS boundaries give back the documents, text for text
        texts = gpt2.decode(flat).split("<|endoftext|>")
        assert texts[:-1] == part[: len(texts) - 1] and len(texts) - 1 >= len(part) - 1
    # the saved tokenizer is the one in the manifest
    assert load_tokenizer(str(owt_dir / "tokenizer")).sha256 == gpt2.sha256


def test_lm1b_round_trip_bert(tmp_path):
    bert = load_tokenizer("bert-base-uncased")
    lines = [ln.strip() for d in builtin_text("pydoc_topics")[:8] for ln in d.splitlines() if ln.strip()][:300]
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.txt").write_text("\n".join(lines[:150]) + "\n")
    (tmp_path / "train" / "b.txt").write_text("\n".join(lines[150:-40]) + "\n")
    (tmp_path / "test.txt").write_text("\n".join(lines[-40:]) + "\n")
    out = tmp_path / "lm1b"
    assert cli_main(["prepare", "--input", str(tmp_path / "train"), "--output", str(out), "--preset", "lm1b",
                      "--val-input", str(tmp_path / "test.txt"), "--samples-per-shard", "16", "--num-proc", "1"]) == 0
    m = read_manifest(str(out))
    assert (m["seq_len"], m["packing"], m["tokenizer"]["name"]) == (128, "wrapped_bos_eos", "bert-base-uncased")
    flat = _rows(out, "train").reshape(-1).tolist()
    for split, part in (("train", lines[:-40]), ("val", lines[-40:])):
        got = _rows(out, split).reshape(-1).tolist()
        expect = [t for s in part for t in [101] + bert.encode(s) + [102]]
        assert got == expect[: len(got)] and len(expect) - len(got) < 128
    # [CLS] ... [SEP] framing of every sentence
    starts = [i for i, t in enumerate(flat) if t == 101]
    ends = [i for i, t in enumerate(flat) if t == 102]
    assert starts[0] == 0 and all(e < s for e, s in zip(ends, starts[1:]))
    first = flat[1:ends[0]]
    assert bert.decode(first) == bert.decode(bert.encode(lines[0]))


def test_prepare_resume_and_rerun(tmp_path, owt_dir, monkeypatch, docs):
    src = owt_dir.parent / "docs.jsonl"
    ref = read_manifest(str(owt_dir))
    out = tmp_path / "again"
    kw = dict(tokenizer="gpt2", seq_len=64, packing="wrapped", val_docs=3, samples_per_shard=40,
              num_proc=1, docs_per_task=4)
    real_write, calls = shard_writer.SplitWriter._write, []

    def dying_write(self, rows, next_doc):
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated preemption")
        calls.append(1)
        real_write(self, rows, next_doc)

    monkeypatch.setattr(shard_writer.SplitWriter, "_write", dying_write)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(str(src), str(out), **kw, **QUIET)
    monkeypatch.setattr(shard_writer.SplitWriter, "_write", real_write)
    assert not (out / "manifest.json").exists() and (out / "manifest.partial.json").exists()
    with pytest.raises(ValueError, match="unfinished"):
        build_loader(DataConfig(source=str(out), seq_len=64), split="train", tokenizer=load_tokenizer("gpt2"),
                     micro_batch=2)
    logs = []
    m = prep.prepare(str(src), str(out), **kw, log=logs.append)
    assert any("3 shards already complete; resuming at document" in s for s in logs)
    sha = lambda man: [(s["path"], s["sha256"]) for sp in ("train", "val") for s in man["splits"][sp]["shards"]]  # noqa: E731
    assert sha(m) == sha(ref)  # resumed mid-document == uninterrupted, and 1 process == 2 processes
    logs.clear()
    prep.prepare(str(src), str(out), **kw, log=logs.append)
    assert any("nothing to do" in s for s in logs)
    # a damaged shard is re-made on re-run; nothing else changes
    (out / "train" / "shard-000002.tar").write_bytes(b"junk")
    logs.clear()
    assert sha(prep.prepare(str(src), str(out), **kw, log=logs.append)) == sha(ref)
    assert any("shard-000002.tar: missing or changed" in s for s in logs)
    with pytest.raises(ValueError, match="--output: .*other settings.*seq_len"):
        prep.prepare(str(src), str(out), **{**kw, "seq_len": 32}, **QUIET)


def test_prepare_bad_input(tmp_path, capsys):
    with pytest.raises(ValueError, match="--input: cannot load Hugging Face dataset 'no-such-org/no-such-data'"):
        prep.prepare("no-such-org/no-such-data", str(tmp_path / "o"), **QUIET)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="--input: .*empty.jsonl: empty file"):
        prep.prepare(str(tmp_path / "empty.jsonl"), str(tmp_path / "o"), **QUIET)
    (tmp_path / "x.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    with pytest.raises(ValueError, match="--text-field: .*no column 'text' \\(columns: body\\)"):
        prep.prepare(str(tmp_path / "x.jsonl"), str(tmp_path / "o"), **QUIET)
    with pytest.raises(ValueError, match="--input: .*no full sequence"):
        prep.prepare(str(tmp_path / "x.jsonl"), str(tmp_path / "o"), text_field="body", seq_len=64, **QUIET)
    assert cli_main(["prepare", "--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o")]) == 2
    assert "--input: no such file" in capsys.readouterr().err


def _cfg(out, **kw):
    return DataConfig(source=str(out), seq_len=64, with_sample_ids=True, **kw)


def _epoch0_ids(cfg, tok, dp_size, seed=0, micro_batch=4):
    """Sample ids of epoch 0 per rank, read until every reader of the rank has passed epoch 0."""
    per_rank = []
    for r in range(dp_size):
        ld = build_loader(cfg, split="train", tokenizer=tok, micro_batch=micro_batch, dp_rank=r, dp_size=dp_size,
                          seed=seed)
        ids = []
        for b in ld:
            ids += b["sample_id"][b["epoch"] == 0].tolist()
            if b["epoch"].numel() and (b["epoch"] >= 1).all():
                break
        per_rank.append(ids)
    return per_rank


def test_two_ranks_two_workers_exactly_once(owt_dir, gpt2):
    n = read_manifest(str(owt_dir))["splits"]["train"]["num_samples"]
    per_rank = _epoch0_ids(_cfg(owt_dir, num_workers=2), gpt2, dp_size=2)
    assert sorted(per_rank[0] + per_rank[1]) == list(range(n))
    assert set(per_rank[0]).isdisjoint(per_rank[1])
    assert _epoch0_ids(_cfg(owt_dir, num_workers=2), gpt2, dp_size=2) == per_rank  # same seed, same order
    base = _epoch0_ids(_cfg(owt_dir), gpt2, dp_size=2)
    assert base == per_rank  # workers are not part of the order
    one = _epoch0_ids(_cfg(owt_dir), gpt2, dp_size=1, micro_batch=8)[0]
    assert sorted(one) == list(range(n))
    # DP=1 (micro 8) reads, per 8-sample global batch, rank 0's 4 samples then rank 1's
    merged = [i for k in range(0, n, 4) for i in (per_rank[0][k:k + 4] + per_rank[1][k:k + 4])]
    assert merged[:len(one)] == one[:len(merged)]
    assert _epoch0_ids(_cfg(owt_dir), gpt2, dp_size=2, seed=1) != base
    # epoch 1 is another order of the same samples
    ld = build_loader(_cfg(owt_dir), split="train", tokenizer=gpt2, micro_batch=4)
    ids = torch.cat([b["sample_id"] for _, b in zip(range(2 * n // 4), ld)])
    assert sorted(ids[:n].tolist()) == sorted(ids[n:2 * n].tolist()) == list(range(n))
    assert not torch.equal(ids[:n], ids[n:2 * n])


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_next_batch(owt_dir, gpt2, workers):
    cfg = _cfg(owt_dir, num_workers=workers, shuffle_window=2)
    make = lambda: build_loader(cfg, split="train", tokenizer=gpt2, micro_batch=8, dp_rank=1, dp_size=2,  # noqa: E731
                                seed=7)
    ref = make()
    it = iter(ref)
    for _ in range(11):
        next(it)
    state = json.loads(json.dumps(ref.state_dict()))  # as it would travel through a checkpoint
    expect = [next(it) for _ in range(60)]  # crosses epoch boundaries
    assert ref.epoch >= 1
    resumed = make()
    resumed.load_state_dict(state)
    got = [b for _, b in zip(range(60), resumed)]
    for a, b in zip(expect, got):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["sample_id"], b["sample_id"])


def test_val_split_equal_batches_per_rank(owt_dir, gpt2):
    n = read_manifest(str(owt_dir))["splits"]["val"]["num_samples"]
    seen = []
    for r, workers in ((0, 2), (1, 0)):  # which samples a rank evaluates does not depend on its workers
        ld = build_loader(_cfg(owt_dir, num_workers=workers), split="val", tokenizer=gpt2, micro_batch=2,
                          dp_rank=r, dp_size=2)
        batches = list(ld)
        assert len(batches) == len(ld) == n // 4 and all(b["input_ids"].shape == (2, 64) for b in batches)
        assert [b["sample_id"].tolist() for b in ld] == [b["sample_id"].tolist() for b in batches]
        seen += [i for b in batches for i in b["sample_id"].tolist()]
    assert sorted(seen) == list(range(n // 4 * 4)) and ld.dropped_samples == n % 4


def test_manifest_mismatch(owt_dir, gpt2):
    bert = load_tokenizer("bert-base-uncased")
    with pytest.raises(ValueError, match="^data.tokenizer: 'bert-base-uncased'.*'gpt2'"):
        build_loader(_cfg(owt_dir), split="train", tokenizer=bert, micro_batch=2)
    with pytest.raises(ValueError, match="^data.seq_len: 128, but .* 64 tokens"):
        build_loader(DataConfig(source=str(owt_dir)), split="train", tokenizer=gpt2, micro_batch=2)
    with pytest.raises(ValueError, match="^data.packing: 'wrapped_bos_eos'"):
        build_loader(_cfg(owt_dir, packing="wrapped_bos_eos"), split="train", tokenizer=gpt2, micro_batch=2)
    with pytest.raises(ValueError, match="^data.source: .*no such directory"):
        build_loader(_cfg(owt_dir.parent / "nowhere"), split="train", tokenizer=gpt2, micro_batch=2)
    ld = build_loader(_cfg(owt_dir, num_workers=2), split="train", tokenizer=gpt2, micro_batch=2, dp_size=2)
    with pytest.raises(ValueError, match="shuffle_window=4, this loader has shuffle_window=2"):
        build_loader(_cfg(owt_dir, shuffle_window=2), split="train", tokenizer=gpt2, micro_batch=2,
                     dp_size=2).load_state_dict(ld.state_dict())


@pytest.fixture
def damaged(tmp_path, owt_dir):
    import shutil

    out = tmp_path / "damaged"
    shutil.copytree(owt_dir, out)
    p = out / "train" / "shard-000001.tar"
    p.write_bytes(p.read_bytes()[:5000])  # truncated mid-sample
    q = out / "train" / "shard-000003.tar"
    data = bytearray(q.read_bytes())
    data[3000] ^= 0xFF  # one flipped byte in token data
    q.write_bytes(bytes(data))
    return out


def test_corrupt_shards_raise(damaged, gpt2):
    for workers in (0, 2):
        ld = build_loader(_cfg(damaged, num_workers=workers, shuffle=False), split="train", tokenizer=gpt2,
                          micro_batch=4)
        with pytest.raises(ShardError, match=r"^\S*shard-00000[13]\.tar: "):
            for _ in ld:
                pass
    src = ShardSource(str(damaged), read_manifest(str(damaged)), verify=True)
    with pytest.raises(ShardError, match=r"shard-000001\.tar: 5000 bytes, the manifest says"):
        src.read_unit("train", 1)
    with pytest.raises(ShardError, match=r"shard-000003\.tar: sha256 does not match"):
        src.read_unit("train", 3)
    unverified = ShardSource(str(damaged), read_manifest(str(damaged)), verify=False)
    with pytest.raises(ShardError, match=r"shard-000001\.tar: .*(truncated|holds)"):
        unverified.read_unit("train", 1)
    assert cli_main(["inspect", str(damaged), "--verify"]) == 1


def test_skip_bad_shards_counts(damaged, gpt2):
    m = read_manifest(str(damaged))
    bad = {s["first_sample"] + i for k in (1, 3) for s in [m["splits"]["train"]["shards"][k]]
           for i in range(s["num_samples"])}
    n = m["splits"]["train"]["num_samples"]
    per_rank = _epoch0_ids(_cfg(damaged, num_workers=2, skip_bad_shards=True), gpt2, dp_size=1)
    assert sorted(per_rank[0]) == sorted(set(range(n)) - bad)
    ld = build_loader(_cfg(damaged, skip_bad_shards=True), split="train", tokenizer=gpt2, micro_batch=4)
    for b in ld:
        if ld.epoch >= 1:
            break
    assert ld.skipped_shards >= 2 and ld.skipped_samples >= len(bad)
    assert ld.state_dict()["skipped_samples"] == ld.skipped_samples


def test_parquet_input_and_fsspec_source(tmp_path, gpt2):
    import datasets
    import fsspec

    texts = builtin_text("pydoc_topics")[:6]
    datasets.Dataset.from_dict({"content": texts}).to_parquet(str(tmp_path / "d.parquet"))
    out = tmp_path / "pq"
    assert cli_main(["prepare", "--input", str(tmp_path / "d.parquet"), "--out", str(out), "--text-field", "content",
                     "--seq-len", "32", "--samples-per-shard", "50", "--num-proc", "1"]) == 0
    flat = _rows(out, "train").reshape(-1).tolist()
    assert flat == [t for d in texts for t in gpt2.encode(d) + [gpt2.eos_id]][: len(flat)]
    # the same shards through an fsspec URL (in-memory filesystem stands in for s3:// or gs://)
    fs = fsspec.filesystem("memory")
    for f in out.rglob("*"):
        if f.is_file():
            fs.pipe(f"/pq/{f.relative_to(out).as_posix()}", f.read_bytes())
    cfg = DataConfig(source="memory://pq", seq_len=32, shuffle=False)
    batch = next(iter(build_loader(cfg, split="train", tokenizer=gpt2, micro_batch=4)))
    assert batch["input_ids"].flatten().tolist() == flat[: 4 * 32]


def test_resume_through_torch_checkpoint(tmp_path, owt_dir, gpt2):
    cfg = _cfg(owt_dir, num_workers=2)
    ref = build_loader(cfg, split="train", tokenizer=gpt2, micro_batch=4, dp_rank=0, dp_size=2, seed=3)
    it = iter(ref)
    for _ in range(5):
        next(it)
    torch.save({"step": 5, "data": ref.state_dict()}, tmp_path / "extra_rank0.pt")
    expect = [next(it)["sample_id"].tolist() for _ in range(20)]
    del it
    resumed = build_loader(cfg, split="train", tokenizer=gpt2, micro_batch=4, dp_rank=0, dp_size=2, seed=3)
    resumed.load_state_dict(torch.load(tmp_path / "extra_rank0.pt", weights_only=True)["data"])
    assert [b["sample_id"].tolist() for _, b in zip(range(20), resumed)] == expect


def test_a_caller_changing_its_tokenizer_leaves_the_next_callers_alone():
    """load_tokenizer caches per process; what one caller sets (a chat template) is its own."""
    mine = load_tokenizer("gpt2")
    mine.chat_template = "{{ messages }}"
    assert load_tokenizer("gpt2").chat_template is None
    assert load_tokenizer("gpt2").encode("hello world") == mine.encode("hello world")
