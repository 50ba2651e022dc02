"""Per-sample noise (model/noise.py): a sample's draws depend on (seed, stream, its global index) only."""

import pytest
import torch

from model import families
from model.config import ModelConfig, ObjectiveConfig
from model.noise import TRAIN, VAL, SampleNoise, mix
from model.objectives import build_objective

M = 1 << 64


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) % M
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % M
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % M
    return x ^ (x >> 31)


def test_mix_is_splitmix64():
    xs = [0, 1, -1, 123456789, 2**62 + 5, -(2**63)]
    assert [int(v) % M for v in mix(torch.tensor(xs))] == [_splitmix64(x % M) for x in xs]


def test_draws_follow_the_sample_not_the_batch():
    whole = SampleNoise(3, torch.arange(16, 24), 8)
    halves = [SampleNoise(3, torch.arange(a, a + 4), 8) for a in (16, 20)]
    u = whole.uniform((8, 5, 3))
    assert torch.equal(u, torch.cat([h.uniform((4, 5, 3)) for h in halves]))
    t = whole.noise_levels(16, 1e-3, True)  # 2 levels per sample
    assert torch.equal(t, torch.cat([h.noise_levels(8, 1e-3, True) for h in halves]))
    # stratified over the global batch: 16 levels evenly spaced (mod 1) from one uniform
    s = ((t - 1e-3) / (1 - 1e-3)).sort().values
    gaps = s.diff()
    assert torch.allclose(gaps, torch.full_like(gaps, 1 / 16), atol=1e-5)
    other = SampleNoise(3, torch.arange(16, 24), 8, VAL).uniform((8, 5, 3))
    assert not torch.equal(other, u) and not torch.equal(SampleNoise(4, torch.arange(16, 24), 8).uniform((8, 5, 3)), u)
    big = SampleNoise(0, torch.arange(4), 4, TRAIN).uniform((4, 250_000))
    assert abs(big.mean().item() - 0.5) < 2e-3 and 0.0 <= big.min() and big.max() < 1.0


@pytest.mark.parametrize("name", [n for n in families.names() if not families.get(n).exact_likelihood])
def test_prepare_is_the_same_in_any_micro_batch(name):
    L = 16
    model = ModelConfig(n_layers=1, hidden=16, n_heads=2, ffn_hidden=32, vocab_size=100, mask_id=99, max_seq_len=L)
    obj = build_objective(ObjectiveConfig(name=name, set_size=2, block_size=4), model, L)
    x = torch.randint(0, 99, (8, L), generator=torch.Generator().manual_seed(0))
    idx = torch.arange(40, 48)

    def prep(rows):
        return obj.prepare({"input_ids": x[rows], "sample_index": idx[rows]}, SampleNoise(5, idx[rows], 8))

    whole = prep(slice(0, 8))
    parts = [prep(slice(a, a + 2)) for a in range(0, 8, 2)]
    for field in ("input_ids", "position_ids", "targets", "loss_weight"):
        assert torch.equal(getattr(whole, field), torch.cat([getattr(p, field) for p in parts])), field
    assert whole.loss_weight.sum() > 0
