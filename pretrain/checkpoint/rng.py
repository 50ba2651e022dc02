"""The random-number state a checkpoint keeps per rank (in extra_rank*.pt), as weights-only values."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) generator states as plain values and tensors (loadable as
    weights only: numpy's key array is stored as a tensor)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32) if torch.is_tensor(keys) else keys, *rest))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
