"""megatron-core on a CPU-only torch: the whole compatibility layer, in one place.

megatron-core's tensor-parallel layers and `parallel_state` run on CPU with gloo as they are. Its
pipeline schedules and RNG tracker assume CUDA:

- `p2p_communication` allocates receive buffers with `device=torch.cuda.current_device()` and calls
  `torch.cuda.synchronize()`;
- `schedules` creates counters with a literal `device="cuda"`;
- `tensor_parallel.random.CudaRNGStatesTracker` keeps CUDA generator states
  (`get_cuda_rng_tracker().fork()` is how megatron code draws tensor-parallel dropout masks and
  recomputes activations).

`cpu_compat()` is a context manager that makes those calls work on CPU: a device stub
(`torch.cuda.current_device()` -> 0, `torch.cuda.synchronize()` -> no-op) and a `TorchFunctionMode`
that rewrites every CUDA `device=` argument of a tensor factory to the CPU. `install_cpu_rng_tracker()`
replaces megatron's tracker by one that forks CPU generator states.

Everything here is used only when CUDA is absent (`needed()`); on a GPU the callers use
`contextlib.nullcontext()` instead and megatron runs untouched. Nothing is patched at import time:
the stubs exist only inside the `with cpu_compat():` block (the pipeline step), so DeepSpeed's and
torch's own device detection never see them.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


def needed() -> bool:
    """True when megatron's CUDA-only code paths must be redirected to the CPU."""
    return not torch.cuda.is_available()


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # an integer device is a CUDA ordinal
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpu(TorchFunctionMode):
    """Rewrites `device=<cuda>` keyword arguments (torch.empty/zeros/tensor/..., Tensor.to) to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            if func is torch.Tensor.cuda:
                return args[0]
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_compat():
    """Run megatron-core's pipeline schedules on a CPU-only torch (no-op stubs restored on exit)."""
    saved = (torch.cuda.current_device, torch.cuda.synchronize)
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        with CudaToCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved


def megatron_compat():
    """`cpu_compat()` without CUDA, a null context with it: wrap megatron schedule calls in this."""
    return cpu_compat() if needed() else contextlib.nullcontext()


class CpuRNGStatesTracker:
    """megatron's RNG tracker API (`add`, `fork`, `get_states`, `set_states`, `reset`) on CPU generator
    states: `fork(name)` swaps the global CPU generator state for the named one and back."""

    def __init__(self):
        self.reset()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict) -> None:
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def install_cpu_rng_tracker(seed: int, tp_rank: int = 0) -> CpuRNGStatesTracker:
    """Replace megatron's CUDA RNG tracker by a CPU one seeded like `model_parallel_cuda_manual_seed`
    (tensor-parallel region: seed + 2718 + tp_rank; data-parallel region: seed)."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRNGStatesTracker()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker


__all__ = ["needed", "cpu_compat", "megatron_compat", "sequence_parallel_compat", "CudaToCpu", "CpuRNGStatesTracker", "install_cpu_rng_tracker"]


@contextlib.contextmanager
def sequence_parallel_compat():
    """megatron's sequence-parallel all-gathers and reduce-scatters (gloo has both) allocate their
    buffers on `torch.cuda.current_device()`, also inside autograd backward functions, where a
    TorchFunctionMode does not reach: on a CPU-only torch, make that call name the CPU for the
    duration of the forward and backward (restored on exit)."""
    if not needed():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = saved
