"""Process groups for the model: torch.distributed (common/dist.py) plus megatron-core's parallel_state.

The axes, in megatron-core's rank order tp-cp-ep-dp-pp (neighbouring ranks share a TP group, then a CP
group): tensor (tp), context (cp), data (dp) and pipeline (pp) parallelism; world = tp * cp * dp * pp.

- The ranks of a CP group hold the same weights and read the same samples, each its own slice of every
  sequence (head-tail chunks of both streams); they exchange K/V inside attention.
- The data loader is split over the dp ranks only (`data_rank`, `data_size`): a CP group reads one
  slice of the global batch.
- Gradients are reduced, and ZeRO partitions weights, masters and moments, over the dp * cp ranks that
  hold the same weights (`replica_group`, `replica_rank`, `replica_size`). A checkpoint treats those
  ranks as one replica set, so it reshards across cp as across dp.
"""

from __future__ import annotations

import torch.distributed as dist
from .mcore import parallel_state

from common.dist import ensure_process_group  # the one process-group initialiser (re-exported here)
from common.schema import ConfigError


def ensure_model_parallel(tp: int = 1, pp: int = 1, cp: int = 1) -> None:
    """Initialise megatron-core's groups for (tp, pp, cp) if they are not already set up that way."""
    ensure_process_group()
    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() == tp
                and parallel_state.get_pipeline_model_parallel_world_size() == pp
                and parallel_state.get_context_parallel_world_size() == cp):
            return
        parallel_state.destroy_model_parallel()
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ConfigError(f"parallel: world size {world} is not divisible by tp*cp*pp = {tp}*{cp}*{pp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp)


# -- the data axis (the loader) and the replica axis (gradients, ZeRO, checkpoints) -----------------------
def data_rank() -> int:
    """This rank's index among the dp ranks that read different samples (CP peers share it)."""
    return parallel_state.get_data_parallel_rank(with_context_parallel=False)


def data_size() -> int:
    return parallel_state.get_data_parallel_world_size(with_context_parallel=False)


def data_group():
    """The dp ranks that read different samples (one per CP group): sums of what the loader read."""
    return parallel_state.get_data_parallel_group(with_context_parallel=False)


def replica_group():
    """The dp * cp ranks that hold the same weights: gradient reduction and ZeRO partitioning."""
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def replica_rank() -> int:
    return parallel_state.get_data_parallel_rank(with_context_parallel=True)


def replica_size() -> int:
    return parallel_state.get_data_parallel_world_size(with_context_parallel=True)


def cp_group():
    return parallel_state.get_context_parallel_group()


def cp_rank() -> int:
    return parallel_state.get_context_parallel_rank()


def cp_size() -> int:
    return parallel_state.get_context_parallel_world_size()
