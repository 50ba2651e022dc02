"""Linear and embedding layers: megatron-core's tensor-parallel ones when the model is split over
several tensor-parallel ranks, plain torch ones with the same parameters at TP=1.

megatron-core's `ColumnParallelLinear`, `RowParallelLinear` and `VocabParallelEmbedding` look up
their tensor-parallel process group in every forward (its `RowParallelLinear` all-reduces even over
one rank), so they cannot run in a process where torch.distributed was never initialised. At TP=1
nothing is split, and the layers below stand in for them exactly:

- the same parameter names and shapes (`weight` [out, in], `bias`), the same state-dict
  entries (megatron's linears add an empty `_extra_state`), and the same layout attributes megatron sets (`tensor_model_parallel`,
  `partition_dim`, `partition_stride`), so checkpoints interchange with any TP size;
- the same initialisation: the full fp32 master weight is drawn with `init_method` exactly as
  megatron's CPU initialisation draws it (one `torch.empty` + `init_method`, then a cast), biases
  are zero, so a seed gives the same weights as under TP > 1;
- the same arithmetic: `matmul(x, W^T)` then `+ b`, as megatron's linear function computes it, and
  the `(output, bias)` return convention.

The choice depends only on the TP size in the layer's `ModelParallelConfig`, so a TP=1 model is
always built from these layers, whether it trains under DeepSpeed or decodes in a plain Python
session. `vocab_cross_entropy` does the same for megatron's vocab-parallel cross-entropy (its own
forward and backward steps, without the all-reduces). tests/test_model_layers.py checks values,
outputs and gradients against megatron's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy


def _layout(p: torch.nn.Parameter, dim: int) -> None:
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1


class _Local(torch.nn.Module):
    """The master-weight initialisation megatron's CPU initialisation does."""

    def _init_weight(self, rows: int, cols: int, init_method: Callable, config: ModelParallelConfig, dim: int):
        master = torch.empty(rows, cols, dtype=torch.float)
        if config.perform_initialization:
            init_method(master)
        self.weight = torch.nn.Parameter(master.to(config.params_dtype))
        _layout(self.weight, dim)


class LocalLinear(_Local):
    """`y = x W^T + b` with megatron's `(output, output_bias)` interface; `split_dim` records which
    dimension megatron would split (0: column parallel, 1: row parallel)."""

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig, init_method: Callable,
                 bias: bool, split_dim: int, skip_bias_add: bool = False):
        super().__init__()
        self.input_size, self.output_size, self.skip_bias_add = input_size, output_size, skip_bias_add
        self._init_weight(output_size, input_size, init_method, config, split_dim)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype))
            if split_dim == 0:
                _layout(self.bias, 0)
        else:
            self.register_parameter("bias", None)

    def get_extra_state(self) -> Any:  # megatron's linears save an `_extra_state` entry (None)
        return None

    def set_extra_state(self, state: Any) -> None:
        pass

    def forward(self, x: torch.Tensor):
        out = torch.matmul(x, self.weight.t())
        if self.bias is not None and not self.skip_bias_add:
            return out + self.bias, None
        return out, self.bias


class LocalEmbedding(_Local):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Callable, config: ModelParallelConfig):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._init_weight(num_embeddings, embedding_dim, init_method, config, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight)


def column_linear(input_size: int, output_size: int, *, config: ModelParallelConfig, init_method, bias: bool):
    """Output dimension split over TP ranks (megatron ColumnParallelLinear, gather_output=False)."""
    if config.tensor_model_parallel_size > 1:
        return tensor_parallel.ColumnParallelLinear(input_size, output_size, config=config, init_method=init_method,
                                                    bias=bias, gather_output=False)
    return LocalLinear(input_size, output_size, config=config, init_method=init_method, bias=bias, split_dim=0)


def row_linear(input_size: int, output_size: int, *, config: ModelParallelConfig, init_method, bias: bool,
               skip_bias_add: bool = False):
    """Input dimension split over TP ranks, output all-reduced (megatron RowParallelLinear); with
    `skip_bias_add` the bias is returned, not added (sequence parallelism adds it itself)."""
    if config.tensor_model_parallel_size > 1:
        return tensor_parallel.RowParallelLinear(input_size, output_size, config=config, init_method=init_method,
                                                 bias=bias, input_is_parallel=True, skip_bias_add=skip_bias_add)
    return LocalLinear(input_size, output_size, config=config, init_method=init_method, bias=bias, split_dim=1,
                       skip_bias_add=skip_bias_add)


def vocab_embedding(num_embeddings: int, embedding_dim: int, *, config: ModelParallelConfig, init_method):
    """Vocabulary split over TP ranks (megatron VocabParallelEmbedding)."""
    if config.tensor_model_parallel_size > 1:
        return tensor_parallel.VocabParallelEmbedding(num_embeddings, embedding_dim, init_method=init_method,
                                                      config=config)
    return LocalEmbedding(num_embeddings, embedding_dim, init_method=init_method, config=config)


def is_column(layer) -> bool:
    return isinstance(layer, tensor_parallel.ColumnParallelLinear) or (
        isinstance(layer, LocalLinear) and layer.weight.partition_dim == 0)


def is_row(layer) -> bool:
    return isinstance(layer, tensor_parallel.RowParallelLinear) or (
        isinstance(layer, LocalLinear) and layer.weight.partition_dim == 1)


class _LocalCrossEntropy(torch.autograd.Function):
    """megatron's vocab-parallel cross-entropy over one rank: its own forward and backward steps
    (`VocabParallelCrossEntropy`), without the all-reduces, which are identities at TP=1. Like
    megatron's, it works in place on an fp32 input."""

    @staticmethod
    def forward(ctx, logits, target):
        ops = VocabParallelCrossEntropy
        logits, logits_max = ops.calculate_logits_max(logits)
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = ops.calculate_predicted_logits(
            logits, target, logits_max, 0, logits.size(-1))
        exp_logits, loss = ops.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        ops = VocabParallelCrossEntropy
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, softmax_update, grad_input = ops.prepare_gradient_calculation_operands(softmax, target_mask)
        return ops.calculate_gradients(grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output), None


def vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy of vocab-parallel logits [..., V/tp] (megatron's, in place on fp32
    input): over the tensor-parallel group when there is one of size > 1, else on this process."""
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_tensor_model_parallel_world_size() > 1:
        return tensor_parallel.vocab_parallel_cross_entropy(logits, target)
    return _LocalCrossEntropy.apply(logits, target)
