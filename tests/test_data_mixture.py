"""Weighted mixtures of prepared sources (data.mixture): per-batch shares, layout invariance, resume,
re-weighting, running out, mismatched sources, and the schedule's arithmetic (data_pipeline/blend.py).

The corpora are real shards of disjoint slices of Python's pydoc topics, made with `setdlm data prepare`."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from common.schema import ConfigError  # noqa: E402
from data_pipeline.blend import Blend, integer_weights  # noqa: E402
from data_pipeline.config import DataConfig  # noqa: E402
from data_pipeline.loader import build_loader  # noqa: E402
from data_pipeline.tokenizers import load_tokenizer  # noqa: E402
from helpers import loader_steps  # noqa: E402
from mixture_data import mixture, prepare_corpora  # noqa: E402

WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    dirs = prepare_corpora(root, {"a": (0, 20), "b": (36, 56), "c": (69, 79), "small": (10, 17)})
    dirs.update(prepare_corpora(root, {"long": (0, 10)}, seq_len=64))
    dirs.update(prepare_corpora(root, {"bert": (0, 10)}, tokenizer="bert-base-uncased"))
    return dirs


def _cfg(corpora, weights=WEIGHTS, **kw):
    return DataConfig(mixture=mixture(corpora, weights), seq_len=32, with_sample_ids=True, **kw)


def _steps(cfg, tok, steps, *, global_batch=8, micro_batch=8, dp_size=1, state=None, seed=3):
    """Per optimizer step, (positions, sources, sample ids) read by all ranks in rank order; and the loaders."""
    return loader_steps(cfg, tok, steps, ("sample_index", "source", "sample_id"), global_batch=global_batch,
                        micro_batch=micro_batch, dp_size=dp_size, state=state, seed=seed)


def _one_source_ids(path, tok, n, seed=3):
    ld = build_loader(DataConfig(source=str(path), seq_len=32, with_sample_ids=True), split="train", tokenizer=tok,
                      micro_batch=1, seed=seed)
    it = iter(ld)
    return [int(next(it)["sample_id"]) for _ in range(n)]


@pytest.mark.slow
def test_every_batch_holds_each_share_to_within_one_sample(corpora, gpt2):
    steps, _ = _steps(_cfg(corpora), gpt2, 100)
    shares = np.array(list(WEIGHTS.values()))
    counts = np.array([np.bincount(src, minlength=3) for _, src, _ in steps])
    assert (np.abs(counts - shares * 8) < 1).all(), counts  # 4 of a, 2.4 of b, 1.6 of c: floor or ceiling
    assert (counts.sum(0) == shares * 800).all()  # whole periods (5 steps): the exact shares
    assert [p for pos, _, _ in steps for p in pos] == list(range(800))
    # inside each source, the one-source order (its own seed-derived permutation): nothing repeated or skipped
    for s, name in enumerate(WEIGHTS):
        ids = [i for _, src, sid in steps for j, i in zip(src, sid) if j == s]
        assert ids == _one_source_ids(corpora[name], gpt2, len(ids)), name


def test_same_order_under_dp_workers_and_micro_batches(corpora, gpt2):
    ref, _ = _steps(_cfg(corpora), gpt2, 12)  # one rank, micro-batch 8, no workers
    assert _steps(_cfg(corpora), gpt2, 12, micro_batch=4, dp_size=2)[0] == ref
    assert _steps(_cfg(corpora, num_workers=2), gpt2, 12, micro_batch=2, dp_size=1)[0] == ref  # 2 x 4 accumulation
    assert _steps(_cfg(corpora, num_workers=2), gpt2, 12, micro_batch=2, dp_size=2)[0] == ref


def test_resume_under_another_layout_continues_with_the_counts(corpora, gpt2):
    ref, _ = _steps(_cfg(corpora), gpt2, 20)
    _, loaders = _steps(_cfg(corpora), gpt2, 7, micro_batch=4, dp_size=2)
    state = loaders[1].state_dict()  # any rank's state
    seen = np.bincount([s for _, src, _ in ref[:7] for s in src], minlength=3)
    assert state["mixture"]["consumed"] == dict(zip(WEIGHTS, seen.tolist()))
    rec = loaders[0].record()
    assert rec["position"] == 56 and [r["samples"] for r in rec["sources"].values()] == seen.tolist()
    assert [r["tokens"] for r in rec["sources"].values()] == (seen * 32).tolist()
    again, _ = _steps(_cfg(corpora, num_workers=2), gpt2, 13, micro_batch=2, state=state)
    assert again == ref[7:]


def test_changed_weights_refused_unless_allowed(corpora, gpt2):
    _, loaders = _steps(_cfg(corpora), gpt2, 6)
    state = loaders[0].state_dict()
    new = {"a": 0.25, "b": 0.25, "c": 0.5}
    ld = build_loader(_cfg(corpora, new), split="train", tokenizer=gpt2, micro_batch=8, seed=3)
    with pytest.raises(ConfigError, match=r"^data\.mixture\[0\]\.weight: 0\.25 .*0\.5 .*data\.allow_reweight=true"):
        ld.load_state_dict(state)
    after, lds = _steps(_cfg(corpora, new, allow_reweight=True), gpt2, 40, state=state)
    assert lds[0].notes and "new schedule" in lds[0].notes[0]
    counts = np.array([np.bincount(src, minlength=3) for _, src, _ in after])
    assert (counts == [2, 2, 4]).all()  # the new shares from the resume step on
    before, _ = _steps(_cfg(corpora), gpt2, 6)
    for s, name in enumerate(WEIGHTS):  # each source continues where it stopped: no sample twice, none skipped
        ids = [i for part in (before, after) for _, src, sid in part for j, i in zip(src, sid) if j == s]
        assert ids == _one_source_ids(corpora[name], gpt2, len(ids)), name
        n_before = sum(j == s for _, src, _ in before for j in src)
        assert lds[0].record()["sources"][name]["samples"] == n_before + counts[:, s].sum()


def test_another_global_batch_starts_a_new_schedule_at_the_resume_step(corpora, gpt2):
    before, loaders = _steps(_cfg(corpora), gpt2, 6)
    after, lds = _steps(_cfg(corpora), gpt2, 30, global_batch=10, micro_batch=5, state=loaders[0].state_dict())
    assert lds[0].notes and "global batch 8 -> 10" in lds[0].notes[0]
    assert [p for pos, _, _ in after for p in pos] == list(range(48, 48 + 300))
    assert all(np.bincount(src, minlength=3).tolist() == [5, 3, 2] for _, src, _ in after)
    for s, name in enumerate(WEIGHTS):  # no sample twice, none skipped
        ids = [i for part in (before, after) for _, src, sid in part for j, i in zip(src, sid) if j == s]
        assert ids == _one_source_ids(corpora[name], gpt2, len(ids)), name


def test_other_sources_refused_by_name(corpora, gpt2):
    _, loaders = _steps(_cfg(corpora), gpt2, 2)
    ld = build_loader(_cfg(corpora, {"a": 0.5, "b": 0.5}), split="train", tokenizer=gpt2, micro_batch=8, seed=3)
    with pytest.raises(ConfigError, match=r"^data\.mixture: the checkpoint's loader read the sources \['a', 'b', 'c'\]"):
        ld.load_state_dict(loaders[0].state_dict())
    one = build_loader(DataConfig(source=str(corpora["a"]), seq_len=32), split="train", tokenizer=gpt2, micro_batch=8)
    ld = build_loader(_cfg(corpora), split="train", tokenizer=gpt2, micro_batch=8, seed=3)
    with pytest.raises(ConfigError, match=r"read one source \(data\.source\)"):
        ld.load_state_dict(one.state_dict())


def test_repeat_and_stop_when_a_source_runs_out(corpora, gpt2):
    w = {"a": 0.75, "small": 0.25}
    n_small = build_loader(DataConfig(source=str(corpora["small"]), seq_len=32), split="train", tokenizer=gpt2,
                           micro_batch=1).num_samples
    stop = build_loader(_cfg(corpora, w, on_exhausted="stop"), split="train", tokenizer=gpt2, micro_batch=2,
                        global_batch=4, seed=3)
    got = list(stop)
    assert len(got) == 2 * n_small and stop.exhausted == "small"  # one sample of it per step: n_small steps
    small = sorted(int(i) for b in got for j, i in zip(b["source"], b["sample_id"]) if j == 1)
    assert small == sorted(_one_source_ids(corpora["small"], gpt2, n_small))  # each once
    assert stop.record()["sources"]["small"]["samples"] == n_small
    again = build_loader(_cfg(corpora, w, on_exhausted="stop"), split="train", tokenizer=gpt2, micro_batch=2,
                         global_batch=4, seed=3)
    again.load_state_dict(stop.state_dict())
    assert list(again) == [] and again.exhausted == "small"  # resumed at the end: nothing more
    rep = build_loader(_cfg(corpora, w), split="train", tokenizer=gpt2, micro_batch=4, seed=3)
    it = iter(rep)
    for _ in range(3 * n_small):
        next(it)
    assert rep.source_epochs() == {"a": 3 * n_small * 3 // rep.mixture.sizes[0], "small": 3}


def test_val_split_is_every_source_end_to_end(corpora, gpt2):
    val = build_loader(_cfg(corpora), split="val", tokenizer=gpt2, micro_batch=4)
    rows = torch.cat([b["input_ids"] for b in val])
    parts = [torch.cat([b["input_ids"] for b in build_loader(DataConfig(source=str(corpora[n]), seq_len=32),
                                                             split="val", tokenizer=gpt2, micro_batch=1)])
             for n in WEIGHTS]
    assert torch.equal(rows, torch.cat(parts)[: len(rows)]) and len(rows) == sum(map(len, parts)) // 4 * 4


def test_mismatched_sources_refused_by_name(corpora, gpt2):
    for bad, field in (("long", "seq_len"), ("bert", "tokenizer")):
        cfg = DataConfig(mixture=mixture(corpora, {"a": 1, bad: 1}), seq_len=32)
        with pytest.raises(ConfigError, match=rf"^data\.mixture\[1\] \({bad}\): data\.{field}: "):
            build_loader(cfg, split="train", tokenizer=gpt2, micro_batch=4)


def test_recipe_keys(corpora, tmp_path):
    from pretrain.config import load_config

    entries = mixture(corpora, {"a": 2, "b": 1})
    with pytest.raises(ConfigError, match=r"^data\.source: set together with data\.mixture.*data\.source=null"):
        DataConfig(source="builtin:pydoc_topics", mixture=entries)
    r = tmp_path / "r.yaml"
    r.write_text("model: {n_layers: 1}\nobjective: {name: ar}\ndata: {source: data/owt, seq_len: 32}\ntrain: {max_steps: 3}\n")
    over = f"data.mixture=[{{source: {corpora['a']}, weight: 2}}, {{source: {corpora['b']}, weight: 1, name: bee}}]"
    with pytest.raises(ConfigError, match=r"^data\.source: set together"):
        load_config(r, [over])
    cfg = load_config(r, [over, "data.source=null"])
    assert cfg.data.source is None and [e.label for e in cfg.data.mixture] == ["a", "bee"]
    from pretrain.config import from_dict

    assert from_dict(cfg.to_dict()).data == cfg.data  # a checkpoint's meta.json config reads back
    for entry, msg in (({"source": "x", "weight": 0}, r"data\.mixture\[1\]\.weight: must be > 0"),
                       ({"source": "x"}, r"data\.mixture\[1\]\.weight: required"),
                       ({"source": "x", "weight": 1, "share": 2}, r"data\.mixture\[1\]\.share: unknown key"),
                       ({"source": str(corpora["a"]), "weight": 1}, r"data\.mixture\[1\]\.name: 'a' already names")):
        with pytest.raises(ConfigError, match="^" + msg):
            DataConfig(mixture=[entries[0], entry]).validate()


@pytest.mark.parametrize("weights,G", [([5, 3, 2], 8), ([1, 1], 7), ([3858, 15625, 11767], 512), ([1, 2, 3, 4, 5], 16)])
def test_blend_quota_period_and_random_access(weights, G):
    b = Blend(weights, G)
    n_batches = max(3 * b.P, 50) if b.P < 2000 else 1000
    src, idx = b.locate(np.arange(n_batches * G))
    share = np.array(weights) / sum(weights)
    per_batch = np.stack([np.bincount(src[k * G:(k + 1) * G], minlength=len(weights)) for k in range(n_batches)])
    assert (np.abs(per_batch - share * G) < 1).all()
    for s in range(len(weights)):  # each source's indices in position order: 0, 1, 2, ... (nothing skipped)
        assert (idx[src == s] == np.arange((src == s).sum())).all()
    for k in {0, 1, min(b.P, n_batches), n_batches - 1}:  # random access = the counts so far; whole periods are exact
        assert (b.counts_before(k) == per_batch[:k].sum(0)).all()
    assert (b.counts_before(b.P) * sum(weights) == np.array(weights) * b.P * G).all()
    later = Blend(weights, G, start=40 * G, start_counts=[7] * len(weights))  # a schedule from a resume position
    s2, i2 = later.locate(np.arange(40 * G, 41 * G))
    assert (s2 == src[:G]).all() and (i2 == idx[:G] + 7).all()


def test_integer_weights():
    assert integer_weights([0.7, 0.3]) == [7, 3] and integer_weights([2.0, 1.0]) == [2, 1]
    assert integer_weights([1 / 3, 2 / 3]) == [1, 2]
    m = integer_weights([1e-7, 1.0, 0.123456789])
    assert sum(m) <= 1 << 16 and m[0] >= 1
