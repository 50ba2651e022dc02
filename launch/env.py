"""Compatibility names: the launcher-environment reader lives in common/env.py and the process-group
initialiser in common/dist.py (so data_pipeline, model, pretrain and eval can use them without
importing launch)."""
from __future__ import annotations

from common.dist import destroy_process_group as destroy_distributed
from common.dist import init_process_group as init_distributed
from common.env import *  # noqa: F403
from common.env import __all__ as _env_all

__all__ = [*_env_all, "init_distributed", "destroy_distributed"]
