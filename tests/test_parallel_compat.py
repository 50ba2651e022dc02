"""The megatron-core CPU compatibility layer (pretrain/compat_cpu.py) and the pipeline stage split."""

from __future__ import annotations

import pytest
import torch

from pretrain import compat_cpu
from pretrain.parallelize import stage_layers


@pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is used only without CUDA")
def test_cuda_devices_map_to_cpu_inside_and_nothing_is_patched_outside():
    assert compat_cpu.needed()
    before = (torch.cuda.current_device, torch.cuda.synchronize)
    with compat_cpu.megatron_compat():
        assert torch.cuda.current_device() == 0
        torch.cuda.synchronize()
        for device in ("cuda", 0, torch.device("cuda:0"), torch.cuda.current_device()):
            assert torch.zeros(2, device=device).device.type == "cpu"
            assert torch.empty((3,), requires_grad=True, device=device).device.type == "cpu"
        assert torch.ones(2).to("cuda").device.type == "cpu"
        assert torch.tensor([1.0], device="cuda").device.type == "cpu"
    assert (torch.cuda.current_device, torch.cuda.synchronize) == before
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_cpu_rng_tracker_forks_named_streams():
    tracker = compat_cpu.CpuRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError):
        tracker.add("b", 1)  # seeds are unique, as in megatron's tracker
    torch.manual_seed(5)
    outside = torch.rand(3)
    torch.manual_seed(5)
    with tracker.fork("a"):
        first = torch.rand(3)
    assert torch.equal(torch.rand(3), outside)  # the global stream did not move
    with tracker.fork("a"):
        second = torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(first, torch.rand(3)) and not torch.equal(first, second)


def test_megatron_uses_the_installed_cpu_tracker():
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    saved = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    try:
        compat_cpu.install_cpu_rng_tracker(seed=3, tp_rank=1)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        assert isinstance(tracker, compat_cpu.CpuRNGStatesTracker)
        with tracker.fork():
            a = torch.rand(2)
        torch.manual_seed(3 + 2718 + 1)
        assert torch.equal(a, torch.rand(2))
    finally:
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved


@pytest.mark.parametrize("n,pp,expected", [
    (4, 2, [range(0, 2), range(2, 4)]),
    (3, 2, [range(0, 2), range(2, 3)]),
    (28, 4, [range(0, 7), range(7, 14), range(14, 21), range(21, 28)]),
    (7, 3, [range(0, 3), range(3, 5), range(5, 7)]),
])
def test_stage_split(n, pp, expected):
    assert [stage_layers(n, pp, s) for s in range(pp)] == expected
