"""A training step does not wait for the device per micro-batch: StepRunner keeps the step's metrics
as device tensors and `reduce` brings them to the host once per logged step (docs/parallelism.md).

On a GPU every `.item()`, `float(t)`, `bool(t)`, `.tolist()` or `.cpu()` of a CUDA tensor blocks the
host until the device catches up. CPU runs have no such stall to measure, so the test counts those
calls, made from the repository's own code, while a step of several micro-batches runs."""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch

from helpers import REPO, write_recipe

# Installed packages (a virtual environment may live inside the checkout, as scripts/install.sh puts it)
LIBRARIES = tuple(sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, *sys.path) if "site-packages" in p}
                         | {sys.prefix, os.path.realpath(sys.prefix)}))
SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "__array__", "cpu")


class SyncCounter:
    """Calls of host-synchronising Tensor methods whose caller is a repository file (not a test)."""

    def __init__(self, monkeypatch):
        self.calls: collections.Counter = collections.Counter()
        self.active = False
        for name in SYNCS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name, method):
        def counted(tensor, *args, **kwargs):
            frame = sys._getframe(1)
            path = frame.f_code.co_filename
            if self.active and path.startswith(str(REPO)) and not path.startswith(LIBRARIES) \
                    and os.sep + "tests" + os.sep not in path:
                self.calls[(os.path.relpath(path, REPO), frame.f_code.co_name, name)] += 1
            return method(tensor, *args, **kwargs)

        return counted

    def __enter__(self):
        self.calls.clear()
        self.active = True
        return self

    def __exit__(self, *exc):
        self.active = False


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_step_of_four_micro_batches_syncs_only_for_the_logged_reduction(tmp_path, model_parallel, monkeypatch,
                                                                          zero_stage):
    from pretrain.config import load_config
    from pretrain.pipeline import add_metrics
    from pretrain.trainer import TRAIN, Trainer

    cfg = load_config(write_recipe(tmp_path / "r.yaml"), [
        f"run.out_dir={tmp_path}", "train.micro_batch=1", "train.global_batch=4", "train.eval_every=0",
        f"parallel.zero_stage={zero_stage}"])
    trainer = Trainer(cfg)
    batches = iter(trainer.train_loader)
    counter = SyncCounter(monkeypatch)
    window: dict = {}
    for _ in range(2):  # two steps of a logging window
        micro = [trainer._prepare(next(batches), TRAIN) for _ in range(4)]
        with counter:
            metrics, gnorm = trainer.stepper.train_step(micro)
            add_metrics(window, metrics)
        # nothing waits, not even the gradient clipping (pretrain/engine.py, ZeRO-0: clipped on the device,
        # train.grad_clip = 1 here; ZeRO-1: DeepSpeed's)
        assert not counter.calls, counter.calls
    assert all(torch.is_tensor(v) and v.dtype == torch.float64 for v in window.values()), window
    with counter:
        total = trainer.stepper.reduce(window)
    assert sum(counter.calls.values()) == 1, counter.calls  # one transfer of every summed metric
    assert set(total) == {"loss_sum", "loss_count"} and total["loss_count"] > 0
    assert 0 < total["loss_sum"] / total["loss_count"] < 20
    assert gnorm is not None and float(gnorm) > 0


@pytest.mark.parametrize("factor", [0.5, 2.0], ids=["clipped", "under the limit"])
def test_clipping_on_the_device_scales_to_max_norm_or_leaves_the_gradients(tmp_path, model_parallel, factor):
    from pretrain.config import load_config
    from pretrain.engine import clip_gradients, global_grad_norm
    from pretrain.trainer import TRAIN, Trainer

    cfg = load_config(write_recipe(tmp_path / "r.yaml"), [f"run.out_dir={tmp_path}", "train.eval_every=0"])
    trainer = Trainer(cfg)
    inputs = trainer._prepare(next(iter(trainer.train_loader)), TRAIN)
    loss, _ = trainer.objective.loss(trainer.engine(inputs.input_ids, inputs.position_ids, **inputs.model_kwargs()),
                                     inputs)
    trainer.engine.backward(loss)
    params = [p for p in trainer.model.parameters() if p.grad is not None]
    before = [p.grad.clone() for p in params]
    norm = float(global_grad_norm(params))
    returned = clip_gradients(trainer.engine, factor * norm)
    assert torch.is_tensor(returned) and float(returned) == norm  # the norm before clipping, on the device
    if factor < 1:
        assert abs(float(global_grad_norm(params)) - factor * norm) <= 1e-5 * norm
        for p, g in zip(params, before):
            torch.testing.assert_close(p.grad, g * (factor * norm / (norm + 1e-6)))
    else:
        assert all(torch.equal(p.grad, g) for p, g in zip(params, before))


def test_add_metrics_sums_in_float64_where_the_values_are():
    from pretrain.pipeline import add_metrics

    acc: dict = {}
    big = torch.tensor(2.0**24, dtype=torch.float32)  # float32 cannot add 1 to it; float64 can
    add_metrics(acc, {"s": big, "n": 3})
    add_metrics(acc, {"s": torch.tensor(1.0), "n": 2})
    assert acc["s"].dtype == torch.float64 and float(acc["s"]) == 2.0**24 + 1 and acc["n"] == 5
