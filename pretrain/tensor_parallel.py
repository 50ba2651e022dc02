"""Tensor and sequence parallelism over megatron-core: the multi-rank `model.layers.TensorParallel`.

The model asks its `TensorParallel` for its linears, embedding and head and for the communication
around them (model/layers.py). Over `size` > 1 ranks this class answers with megatron-core's
`ColumnParallelLinear` (gather_output=False), `RowParallelLinear` (input_is_parallel),
`VocabParallelEmbedding`, its region functions (copy-to / reduce / scatter / gather / reduce-scatter,
Megatron-LM's sequence parallelism) and its vocab-parallel cross-entropy, over megatron's tensor-parallel group
(pretrain/parallel.py initialises it).

The layers are allocated and left uninitialised: megatron's "CPU initialisation" path allocates
without a device argument, so a surrounding `torch.device(...)` context decides where, and with
`perform_initialization=False` it draws nothing; model/init.py then fills each rank's shard with
layout-independent values. That path also skips megatron's layout attributes, which are set here
(`tensor_model_parallel`, `partition_dim`, `partition_stride`: what model/init.py, checkpoints and
the gradient norm read).

At TP=1 `tensor_parallel` returns the model's own one-process implementation: plain torch layers
with the same parameters (tests/test_tensor_parallel_layers.py checks them against megatron's).
"""

from __future__ import annotations

import dataclasses

import torch
from .mcore import parallel_state, tensor_parallel as mtp
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from model.layers import TensorParallel


def megatron_config(tp: int = 1, params_dtype: torch.dtype = torch.float32,
                    sequence_parallel: bool = False) -> ModelParallelConfig:
    """The `ModelParallelConfig` megatron's layers read: allocate only, in `params_dtype`."""
    return ModelParallelConfig(
        tensor_model_parallel_size=tp, use_cpu_initialization=True, perform_initialization=False,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, sequence_parallel=sequence_parallel and tp > 1,
    )


def _not_drawn(weight: torch.Tensor) -> None:  # perform_initialization=False: megatron never calls it
    raise AssertionError("megatron layers are initialised by model/init.py")


def _split(layer: torch.nn.Module, dim: int) -> torch.nn.Module:
    set_tensor_model_parallel_attributes(layer.weight, True, dim, 1)
    return layer


class MegatronTensorParallel(TensorParallel):
    """The model split over megatron's tensor-parallel group of `size` ranks."""

    def __init__(self, size: int, *, sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32):
        super().__init__(params_dtype)
        self.size = size
        self.rank = parallel_state.get_tensor_model_parallel_rank()
        self.sequence_parallel = sequence_parallel and size > 1
        self.config = megatron_config(size, params_dtype, sequence_parallel)

    # -- layers ------------------------------------------------------------------------------------
    def column_linear(self, input_size, output_size, *, bias, config=None):
        return _split(mtp.ColumnParallelLinear(input_size, output_size, config=config or self.config,
                                               init_method=_not_drawn, bias=bias, gather_output=False), 0)

    def row_linear(self, input_size, output_size, *, bias, skip_bias_add=False):
        return _split(mtp.RowParallelLinear(input_size, output_size, config=self.config, init_method=_not_drawn,
                                            bias=bias, input_is_parallel=True, skip_bias_add=skip_bias_add), 1)

    def vocab_embedding(self, num_embeddings, embedding_dim):
        return _split(mtp.VocabParallelEmbedding(num_embeddings, embedding_dim, init_method=_not_drawn,
                                                 config=self.config), 0)

    def vocab_head(self, hidden, vocab, *, bias):
        # the head runs on the gathered sequence: no sequence parallelism in its own config
        return self.column_linear(hidden, vocab, bias=bias,
                                  config=dataclasses.replace(self.config, sequence_parallel=False))

    # -- communication -----------------------------------------------------------------------------
    def all_reduce_grad(self, x):
        return mtp.copy_to_tensor_model_parallel_region(x)

    def scatter_sequence(self, x):
        return mtp.scatter_to_sequence_parallel_region(x)

    def gather_sequence(self, x, reduce_grad=False):
        # The head's input gradient is already complete on every rank (all-reduced by the column-
        # parallel head, or by all_reduce_grad in the tied head), so the gather's backward just splits;
        # a LoRA adapter's rank-r input before a column-parallel B is reduce-scattered (model/lora.py).
        return mtp.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=reduce_grad)

    def reduce(self, x):
        return mtp.reduce_from_tensor_model_parallel_region(x)

    def reduce_scatter_sequence(self, x):
        return mtp.reduce_scatter_to_sequence_parallel_region(x)

    def gather_vocab(self, logits):
        return mtp.gather_from_tensor_model_parallel_region(logits)

    def dropout_rng(self):
        return mtp.get_cuda_rng_tracker().fork()  # the tensor-parallel stream, as Megatron-LM draws dropout

    def cross_entropy(self, logits, target):
        return mtp.vocab_parallel_cross_entropy(logits, target)


def tensor_parallel(tp: int, *, sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32) -> TensorParallel:
    """The model's `TensorParallel` for `tp` ranks: megatron's layers over its group, or at tp = 1 the
    model's own one-process layers (no process group involved)."""
    if tp > 1:
        return MegatronTensorParallel(tp, sequence_parallel=sequence_parallel, params_dtype=params_dtype)
    return TensorParallel(params_dtype)


__all__ = ["MegatronTensorParallel", "megatron_config", "tensor_parallel"]
