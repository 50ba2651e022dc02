"""ZeRO-3's deepspeed.zero.Init build on CUDA (world-1 NCCL group, bf16): the partitions live on the
GPU in bf16, and the run starts from the same weights as ZeRO-1 bf16 (same first loss) and tracks it.

The CPU tests (tests/test_zero3_init.py) check the build, the weights and training under DP=2 with
gloo; this adds the CUDA device, NCCL and DeepSpeed's bf16 ZeRO-3 partitions. Skips without CUDA.
"""

import pytest
import torch

from test_gpu_train import _train

CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (none is visible)")
def test_zero3_init_on_cuda_partitions_on_the_gpu_and_tracks_zero1(tmp_path, model_parallel):
    common = ["train.precision=bf16", "model.dropout=0.0", "train.max_steps=4", "train.eval_every=0"]
    z1, m1 = _train(tmp_path, "z1", ["parallel.zero_stage=1", *common])
    z3, m3 = _train(tmp_path, "z3", ["parallel.zero_stage=3", *common])
    params = list(z3.model.parameters())
    assert all(p.ds_tensor.device.type == "cuda" and p.ds_tensor.dtype == torch.bfloat16 for p in params)
    assert any("deepspeed.zero.Init" in note for note in z3.notes)
    assert m3[1]["train/loss"] == pytest.approx(m1[1]["train/loss"], rel=1e-3)  # the same initial weights
    for step in (2, 3, 4):
        assert m3[step]["train/loss"] == pytest.approx(m1[step]["train/loss"], rel=5e-3), step
