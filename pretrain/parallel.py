"""Process groups for the model: torch.distributed plus megatron-core's parallel_state."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_process_group() -> None:
    """Initialise torch.distributed from the environment, or as a single process (world size 1)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)


def ensure_model_parallel(tp: int = 1, pp: int = 1) -> None:
    """Initialise megatron-core's groups for (tp, pp) if they are not already set up that way."""
    ensure_process_group()
    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() == tp
                and parallel_state.get_pipeline_model_parallel_world_size() == pp):
            return
        parallel_state.destroy_model_parallel()
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"parallel: world size {world} is not divisible by tp*pp = {tp}*{pp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
