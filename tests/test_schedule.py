import pytest
import torch

from model.config import ObjectiveConfig
from model.schedule import SlidingWindow, ranks_of, sample_order


def _orders(L, D, n=8, seed=0, **kw):
    sched = SlidingWindow.build(L, D)
    g = torch.Generator().manual_seed(seed)
    return sched, sample_order(n, L, schedule=sched, generator=g, **kw)


@pytest.mark.parametrize("L,D", [(1024, 4), (1024, 8), (1024, 16), (128, 2), (64, 64)])
def test_expected_budget_is_half_the_set_size(L, D):
    sched = SlidingWindow.build(L, D)
    assert sched.expected_budget == pytest.approx(D / 2, rel=1e-9)
    # Monte Carlo: masked-and-active positions at a uniform time t, averaged.
    g = torch.Generator().manual_seed(1)
    T = sched.masking_times(4096, g)
    t = torch.rand(4096, 1, dtype=torch.float64, generator=g)
    active_masked = (T <= t) & (t < sched.locations() + sched.b)
    assert active_masked.sum(1).double().mean().item() == pytest.approx(sched.expected_budget, rel=0.05)


def test_k_is_about_one_third_for_window_twice_the_set_size():
    assert SlidingWindow.build(1024, 8).k == pytest.approx(1 / 3, rel=0.02)
    assert SlidingWindow.build(64, 8, s_max=8).k == 1.0


@pytest.mark.parametrize("D", [4, 8, 16])
def test_no_position_moves_more_than_window(D):
    L = 1024
    sched, perm = _orders(L, D, n=16)
    disp = (ranks_of(perm) - torch.arange(L)).abs()
    assert disp.max().item() <= sched.s_max - 1


def test_mean_displacement_grows_with_set_size():
    means = []
    for D in (4, 8, 16):
        _, perm = _orders(1024, D, n=16)
        means.append((ranks_of(perm) - torch.arange(1024)).abs().double().mean().item())
    assert means[0] < means[1] < means[2]
    for got, want in zip(means, (1.7, 3.7, 7.5)):
        assert got == pytest.approx(want, rel=0.2)


def test_set_size_one_is_left_to_right():
    _, perm = _orders(100, 1)
    assert torch.equal(perm, torch.arange(100).expand(8, 100))


def test_orders_are_permutations_and_seeded():
    _, a = _orders(64, 4, seed=3)
    _, b = _orders(64, 4, seed=3)
    _, c = _orders(64, 4, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a.sort(1).values, torch.arange(64).expand(8, 64))


def test_context_first_padding_last():
    L = 32
    context = torch.zeros(4, L, dtype=torch.bool)
    context[:, :5] = True
    context[1, 20] = True  # context need not be a prefix
    valid = torch.ones(4, L, dtype=torch.bool)
    valid[:, 28:] = False
    _, perm = _orders(L, 4, n=4, context=context, valid=valid)
    assert torch.equal(perm[0, :5], torch.arange(5))
    assert torch.equal(perm[1, :6], torch.tensor([0, 1, 2, 3, 4, 20]))
    assert torch.equal(perm[:, -4:], torch.arange(28, 32).expand(4, 4))


def test_any_order_is_not_local():
    sched = SlidingWindow.build(256, 4)
    perm = sample_order(4, 256, order="any_order", schedule=sched, generator=torch.Generator().manual_seed(0))
    assert (ranks_of(perm) - torch.arange(256)).abs().max() > 100


@pytest.mark.parametrize("kw,field", [
    (dict(set_size=200), "objective.set_size"),
    (dict(set_size=8, s_max=4), "objective.s_max"),
    (dict(name="gpt"), "objective.name"),
    (dict(name="bd3lm", block_size=7), "objective.block_size"),
])
def test_bad_objective_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ObjectiveConfig(**kw).validate(seq_len=128)
