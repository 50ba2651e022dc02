"""Process groups for the model: torch.distributed (common/dist.py) plus megatron-core's parallel_state."""

from __future__ import annotations

import torch.distributed as dist
from .mcore import parallel_state

from common.dist import ensure_process_group  # the one process-group initialiser (re-exported here)
from common.schema import ConfigError


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
        raise ConfigError(f"parallel: world size {world} is not divisible by tp*pp = {tp}*{pp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
