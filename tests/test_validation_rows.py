"""Validation scores every row of the val split: the last batch is padded with weight-0 rows, and
val/nll (and `eval likelihood`) equal a one-row-at-a-time computation over all rows, under DP too."""

import math

import pytest
import torch

from helpers import REPO, read_metrics, write_recipe
from model import families
from tests.distributed_run import run_distributed


def one_row_at_a_time(trainer) -> dict:
    """Summed bound and tokens of every val row, each row alone in its batch (its own draws, keyed by
    its position in the val order, as in Trainer.validate)."""
    from data_pipeline.loader import build_loader
    from model.noise import VAL, SampleNoise

    cfg = trainer.cfg
    loader = build_loader(cfg.data, split="val", tokenizer=trainer.tokenizer, micro_batch=1, seed=cfg.run.seed)
    nll = tokens = 0.0
    rows = 0
    trainer.model.eval()
    with torch.no_grad():
        for b in loader:
            noise = SampleNoise(cfg.run.seed, b["sample_index"], cfg.train.global_batch, VAL)
            inputs = trainer.objective.prepare(b, noise, bound=True)
            logits = trainer.model(inputs.input_ids, inputs.position_ids, **inputs.model_kwargs())
            _, m = trainer.objective.loss(logits, inputs)
            nll += float(m["nll_sum"])
            tokens += float(m["nll_tokens"])
            rows += 1
    trainer.model.train()
    return {"nll": nll / tokens, "tokens": tokens, "rows": rows, "split": loader.num_samples}


def _trainer(tmp_path, *overrides):
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    recipe = write_recipe(tmp_path / "r.yaml")
    return Trainer(load_config(recipe, [f"run.out_dir={tmp_path}", "train.eval_batches=0", *overrides]))


def test_the_val_loader_pads_the_last_batch_and_covers_every_sample(model_parallel):
    from data_pipeline.config import DataConfig
    from data_pipeline.loader import build_loader
    from data_pipeline.tokenizers import load_tokenizer

    tok = load_tokenizer("gpt2")
    cfg = DataConfig(source="builtin:pydoc_topics", tokenizer="gpt2", seq_len=32, num_workers=0)
    seen = []
    for rank in (0, 1):  # 217 rows; global batch 16 over two ranks: the last step is 9 real rows + 7 filler
        ld = build_loader(cfg, split="val", tokenizer=tok, micro_batch=4, dp_rank=rank, dp_size=2, global_batch=16,
                          pad_last=True)
        assert ld.num_samples == 217 and ld.pad_samples == 7 and len(ld) == 14 * 2
        for j, b in enumerate(ld):
            assert b["input_ids"].shape == (4, 32) and b["pad_row"].shape == (4,)
            real = b["sample_index"][~b["pad_row"]].tolist()
            assert len(real) == ld.batch_rows(j)
            assert all(i >= 217 for i in b["sample_index"][b["pad_row"]].tolist())
            seen += real
    assert sorted(seen) == list(range(217))
    # without pad_last the pass keeps whole global batches (the behaviour other readers rely on)
    assert build_loader(cfg, split="val", tokenizer=tok, micro_batch=16).dropped_samples == 217 % 16


@pytest.mark.parametrize("objective", families.names())
@pytest.mark.slow
def test_val_nll_is_the_one_row_at_a_time_value_over_every_row(tmp_path, model_parallel, objective):
    # 217 val rows in batches of 4: the last batch holds 1 real row and 3 weight-0 filler rows
    trainer = _trainer(tmp_path, f"objective.name={objective}")
    got = trainer.validate()
    ref = one_row_at_a_time(trainer)
    assert ref["rows"] == ref["split"] == 217 and got["val/rows"] == 217
    assert got["val/tokens"] == ref["tokens"]
    assert got["val/nll"] == pytest.approx(ref["nll"], rel=1e-5, abs=0)
    assert got["val/bpt"] == pytest.approx(got["val/nll"] / math.log(2), rel=1e-12)


def _validate_under_dp(out: str) -> dict:
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    recipe = write_recipe(__import__("pathlib").Path(out) / "r.yaml")
    # world 2 = DP 2; global batch 8 = 2 ranks x 1 micro-batch of 4: 217 = 27 x 8 + 1 (7 filler rows)
    trainer = Trainer(load_config(recipe, [f"run.out_dir={out}", "train.eval_batches=0", "train.global_batch=8"]))
    got = trainer.validate()
    ref = one_row_at_a_time(trainer) if trainer.rank == 0 else None  # the replicas hold the same weights
    return {"got": got, "ref": ref}


@pytest.mark.slow
def test_val_nll_under_two_data_parallel_ranks_covers_every_row(tmp_path):
    ranks = run_distributed(_validate_under_dp, 2, str(tmp_path), timeout=600)
    a, b = ranks.results
    ref = a["ref"]
    assert a["got"] == b["got"]  # one reduced value on every rank
    assert a["got"]["val/rows"] == ref["rows"] == 217 and a["got"]["val/tokens"] == ref["tokens"]
    assert a["got"]["val/nll"] == pytest.approx(ref["nll"], rel=1e-5, abs=0)


@pytest.mark.slow
def test_quickstart_val_nll_is_the_mean_over_all_108_rows(tmp_path, model_parallel, capsys):
    """configs/quickstart.yaml with a 2-step train: 108 val rows in global batches of 16 (6 full + 12 rows)."""
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    cfg = load_config(str(REPO / "configs" / "quickstart.yaml"),
                      [f"run.out_dir={tmp_path}", "train.max_steps=2", "train.eval_every=2", "train.save_every=2",
                       "train.log_every=2", "train.sample_at_end=false", "logging.progress=false"])
    trainer = Trainer(cfg)
    trainer.train()
    logged = read_metrics(tmp_path / "quickstart")[2]
    ref = one_row_at_a_time(trainer)
    assert ref["rows"] == 108 and logged["val/rows"] == 108 and logged["val/tokens"] == ref["tokens"]
    assert logged["val/nll"] == pytest.approx(ref["nll"], rel=1e-5, abs=0)
    assert "validation: all 108 rows of the val split, the last batch padded with 4 weight-0 rows" in capsys.readouterr().out
