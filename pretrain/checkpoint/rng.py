"""The random-number state a checkpoint keeps per rank (in extra_rank*.pt), as weights-only values."""

from __future__ import annotations

import random

import numpy as np
import torch

from ..safe_load import CheckpointError


def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) generator states as plain values and tensors (loadable as
    weights only: numpy's key array is stored as a tensor)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def check_rng_state(state, where) -> None:
    """CheckpointError naming `where` (a file) unless `state` is an RNG state of `rng_state()`'s form."""
    ok = (isinstance(state, dict) and isinstance(state.get("python"), tuple) and torch.is_tensor(state.get("torch"))
          and isinstance(state.get("numpy"), (tuple, list)) and len(state["numpy"]) == 5)
    if not ok:
        raise CheckpointError(f"{where}: its random-number state is missing or damaged (needs `rng` with python, "
                              "numpy and torch states); use another step")


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32) if torch.is_tensor(keys) else keys, *rest))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
