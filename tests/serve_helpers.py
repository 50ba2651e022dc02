"""An in-process `setdlm serve` on loopback for tests: the real app, decode loop and sockets, run in a
background thread's event loop (no second Python start-up, so a test module stays fast)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from serve.cli import start, stop


class ThreadServer:
    def __init__(self, served, *, max_batch: int = 8, api_key: str | None = None, max_waiting: int | None = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-serve", daemon=True)
        self.thread.start()
        fut = asyncio.run_coroutine_threadsafe(start(served, host="127.0.0.1", port=0, max_batch=max_batch,
                                                     api_key=api_key, drain_timeout=30, max_waiting=max_waiting),
                                               self.loop)
        self.runner, self.server, (host, port) = fut.result(120)
        self.url = f"http://{host}:{port}"

    @property
    def metrics(self):
        return self.server.metrics

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(stop(self.runner, self.server, 30), self.loop).result(120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def train_tiny(tmp) -> Path:
    """A 2-step tiny SW-SetDLM (GPT-2 tokenizer, 64 positions, S_max 8) whose outputs depend on the
    prompt (large initial weights, almost no training): what the serving tests decode from."""
    import torch

    from helpers import write_recipe
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    recipe = write_recipe(tmp / "r.yaml", model={"init_std": 0.5}, train={"lr": 1e-5})
    cfg = load_config(recipe, [f"run.out_dir={tmp}", "train.max_steps=2", "train.save_every=2", "train.eval_every=2",
                               "train.eval_batches=1", "train.sample_at_end=false"])
    Trainer(cfg).train()
    torch.set_num_threads(threads)
    return tmp / "tiny"
