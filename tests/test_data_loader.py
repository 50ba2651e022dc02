"""Tokenizers, builtin corpus, DataConfig and the in-memory (builtin) loader."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from data_pipeline.config import DataConfig  # noqa: E402
from data_pipeline.corpus import builtin_text  # noqa: E402
from data_pipeline.loader import build_loader  # noqa: E402
from data_pipeline.tokenizers import TokenizerError, load_tokenizer  # noqa: E402
from helpers import loader_steps  # noqa: E402


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def bert():
    return load_tokenizer("bert-base-uncased")


def test_gpt2_ids(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert (gpt2.vocab_size, gpt2.mask_id, gpt2.eos_id, gpt2.bos_id, gpt2.pad_id) == (50258, 50257, 50256, None, None)
    assert gpt2.decode([15496, gpt2.mask_id, 995]) == "Hello<|mask|> world"
    assert gpt2.decode([15496, gpt2.mask_id, 995], skip_special=True) == "Hello world"
    # special-token strings inside text stay text (raw data cannot forge document boundaries)
    assert 50256 not in gpt2.encode("a<|endoftext|>b")


def test_bert_ids(bert):
    assert (bert.vocab_size, bert.mask_id, bert.eos_id, bert.bos_id, bert.pad_id) == (30522, 103, 102, 101, 0)
    ids = bert.encode("Hello, World!")
    assert ids == [7592, 1010, 2088, 999]
    assert bert.decode([101] + ids + [103, 102]) == "[CLS] hello, world! [MASK] [SEP]"


def test_round_trip_text(gpt2, bert):
    docs = builtin_text("pydoc_topics")
    assert len(docs) > 50 and 400_000 < sum(map(len, docs)) < 600_000
    enc = gpt2.encode_batch(docs[:10])
    assert [gpt2.decode(e) for e in enc] == docs[:10]
    enc = bert.encode_batch(docs[:10])
    assert all(bert.encode(bert.decode(e)) == e for e in enc)


def test_save_load(tmp_path, gpt2, bert):
    for tok in (gpt2, bert):
        d = tmp_path / tok.name
        tok.save(d)
        back = load_tokenizer(str(d))
        assert back.sha256 == tok.sha256 and back.name == str(d)
        assert (back.mask_id, back.eos_id, back.bos_id, back.pad_id, back.vocab_size) == \
               (tok.mask_id, tok.eos_id, tok.bos_id, tok.pad_id, tok.vocab_size)
        assert back.encode("Set diffusion, in one shot.") == tok.encode("Set diffusion, in one shot.")
    assert gpt2.sha256 != bert.sha256


def test_tokenizer_without_mask(tmp_path, gpt2):
    from tokenizers import Tokenizer as HF

    raw = HF.from_str(gpt2.backend.to_str())
    d = tmp_path / "nomask"
    d.mkdir()
    # drop the appended mask: rebuild from the JSON without that added token
    import json

    spec = json.loads(raw.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|mask|>"]
    (d / "tokenizer.json").write_text(json.dumps(spec))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    with pytest.raises(TokenizerError, match="no mask token.*add_mask"):
        load_tokenizer(str(d))
    tok = load_tokenizer(str(d), add_mask=True)
    assert tok.mask_id == 50257 and tok.eos_id == 50256 and tok.vocab_size == 50258
    with pytest.raises(TokenizerError, match="not a directory"):
        load_tokenizer(str(tmp_path / "missing"))


def test_config_validation():
    DataConfig().validate()
    for kw, field in [({"seq_len": 0}, "seq_len"), ({"packing": "padded?"}, "packing"),
                      ({"val_fraction": 1.0}, "val_fraction"), ({"num_workers": -1}, "num_workers"),
                      ({"source": "builtin:nope"}, "source"), ({"shuffle": "yes"}, "shuffle")]:
        with pytest.raises(ValueError, match=rf"^data\.{field}: "):
            DataConfig(**kw).validate()
    with pytest.raises(ValueError, match=r"^data\.batch: unknown key"):
        DataConfig.from_dict({"batch": 3})
    assert DataConfig.from_dict({"seq_len": 64}).seq_len == 64


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_builtin_loader_content(gpt2):
    cfg = DataConfig(seq_len=64, shuffle=False, val_fraction=0.1, with_sample_ids=True)
    train = build_loader(cfg, split="train", tokenizer=gpt2, micro_batch=4)
    val = build_loader(cfg, split="val", tokenizer=gpt2, micro_batch=4)
    docs = builtin_text("pydoc_topics")
    stream = [t for d in gpt2.encode_batch(docs) for t in d + [gpt2.eos_id]]
    n = len(stream) // 64
    assert train.num_samples + val.num_samples == n and val.num_samples == int(n * 0.1)
    b = next(iter(train))
    assert b["input_ids"].dtype == torch.long and b["input_ids"].shape == (4, 64)
    assert b["input_ids"].flatten().tolist() == stream[: 4 * 64]  # unshuffled: stream order
    vb = list(val)
    assert len(vb) == len(val) == val.num_samples // 4 and val.dropped_samples == val.num_samples % 4
    first_val = train.num_samples * 64
    assert vb[0]["input_ids"].flatten().tolist() == stream[first_val: first_val + 4 * 64]
    assert [x["input_ids"].tolist() for x in val] == [x["input_ids"].tolist() for x in vb]  # same every pass


def _global_steps(cfg, tok, steps, *, global_batch, micro_batch, dp_size, state=None, seed=3):
    """Per optimizer step, the global positions and manifest ids read by all ranks (rank order)."""
    return loader_steps(cfg, tok, steps, global_batch=global_batch, micro_batch=micro_batch, dp_size=dp_size,
                        state=state, seed=seed)


@pytest.mark.parametrize("workers", [0, 2])
def test_builtin_exactly_once_and_layout_invariant(gpt2, workers):
    cfg = DataConfig(seq_len=128, num_workers=workers, with_sample_ids=True)
    n = build_loader(cfg, split="train", tokenizer=gpt2, micro_batch=8).num_samples
    steps = n // 16 + 3  # crosses the epoch boundary
    two, loaders = _global_steps(cfg, gpt2, steps, global_batch=16, micro_batch=4, dp_size=2)
    flat_pos = [p for pos, _ in two for p in pos]
    assert flat_pos == list(range(steps * 16))  # the global order, sliced by rank and micro-batch
    epoch0 = [i for pos, ids in two for p, i in zip(pos, ids) if p < n]
    assert sorted(epoch0) == list(range(n))  # every sample of epoch 0 exactly once over 2 ranks
    # one process, no workers, another micro-batch: the same samples at the same positions
    one, _ = _global_steps(DataConfig(seq_len=128, with_sample_ids=True), gpt2, steps, global_batch=16,
                           micro_batch=16, dp_size=1)
    assert one == two
    # resume from rank 0's state after 5 steps under DP=4 (micro 2) and under DP=1 with 2 workers
    _, ref = _global_steps(cfg, gpt2, 5, global_batch=16, micro_batch=4, dp_size=2)
    state = ref[0].state_dict()
    for dp, micro, w in ((4, 2, 0), (1, 8, 2)):
        again, _ = _global_steps(DataConfig(seq_len=128, num_workers=w, with_sample_ids=True), gpt2, 3,
                                 global_batch=16, micro_batch=micro, dp_size=dp, state=state)
        assert again == two[5:8], (dp, micro, w)


def test_resume_mid_step(gpt2):
    cfg = DataConfig(seq_len=128, with_sample_ids=True)
    ld = build_loader(cfg, split="train", tokenizer=gpt2, micro_batch=2, dp_size=2, global_batch=8)
    it = iter(ld)
    _take(it, 3)  # mid-step (2 micro-batches per step)
    state = ld.state_dict()
    expect = [b["sample_index"].tolist() for b in _take(it, 5)]
    same = build_loader(cfg, split="train", tokenizer=gpt2, micro_batch=2, dp_size=2, global_batch=8)
    same.load_state_dict(state)
    assert [b["sample_index"].tolist() for b in _take(iter(same), 5)] == expect
    with pytest.raises(ValueError, match="middle of an optimizer step"):
        build_loader(cfg, split="train", tokenizer=gpt2, micro_batch=4, dp_size=2, global_batch=8).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        build_loader(cfg, split="train", tokenizer=gpt2, micro_batch=2, dp_size=2, seed=5,
                     global_batch=8).load_state_dict(state)


def test_order_depends_on_seed_and_epoch(gpt2):
    cfg = DataConfig(seq_len=128, with_sample_ids=True)

    def ids(seed, n=300):
        it = iter(build_loader(cfg, split="train", tokenizer=gpt2, micro_batch=8, seed=seed))
        return torch.cat([b["sample_id"] for b in _take(it, n)])

    a, b, c = ids(0), ids(0), ids(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    n = build_loader(cfg, split="train", tokenizer=gpt2, micro_batch=8).num_samples
    assert a.numel() > 2 * n
    assert not torch.equal(a[:n], a[n:2 * n]) and sorted(a[:n].tolist()) == list(range(n))


def test_bad_arguments(gpt2, bert):
    with pytest.raises(ValueError, match="^split: "):
        build_loader(DataConfig(), split="test", tokenizer=gpt2, micro_batch=2)
    with pytest.raises(ValueError, match="^micro_batch: .*fewer than one global batch"):
        build_loader(DataConfig(), split="val", tokenizer=gpt2, micro_batch=512)
    with pytest.raises(ValueError, match="^dp_rank: "):
        build_loader(DataConfig(), split="train", tokenizer=gpt2, micro_batch=2, dp_rank=2, dp_size=2)
    ld = build_loader(DataConfig(packing="wrapped_bos_eos"), split="train", tokenizer=bert, micro_batch=2)
    assert ld.seq_len == 128 and next(iter(ld))["input_ids"].max() < bert.vocab_size


def test_val_resume_mid_pass(gpt2):
    cfg = DataConfig(seq_len=64, val_fraction=0.1)
    ld = build_loader(cfg, split="val", tokenizer=gpt2, micro_batch=4)
    full = [b["input_ids"] for b in ld]
    it = iter(ld)
    next(it), next(it)
    state = ld.state_dict()
    again = build_loader(cfg, split="val", tokenizer=gpt2, micro_batch=4)
    again.load_state_dict(state)
    rest = [b["input_ids"] for b in again]
    assert len(rest) == len(full) - 2 and all(torch.equal(a, b) for a, b in zip(full[2:], rest))
    assert len([b for b in again]) == len(full)  # the next pass starts from the beginning again
