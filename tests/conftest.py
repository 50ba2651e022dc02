import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def model_parallel():
    """A single-process gloo group with megatron-core's parallel state (TP=1, PP=1)."""
    from model.parallel import ensure_model_parallel

    ensure_model_parallel(1, 1)
    yield
