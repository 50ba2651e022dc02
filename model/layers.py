"""The model's linear, embedding and loss layers, and the one seam where tensor parallelism plugs in.

`TensorParallel` is everything the transformer asks of a tensor-parallel runtime: how its linears,
embedding and output head are built, the few communications around them, and the cross-entropy over
its slice of the vocabulary. The class here is one process (TP=1): plain torch layers, identity
communication, torch alone. pretrain/tensor_parallel.py implements the same interface over several
ranks; the transformer is the same code either way.

The parameters follow the tensor-parallel layout convention that checkpoints, re-layout and the
optimizer read, whatever implementation built them:

- `weight` [out, in] and `bias`, and an empty `_extra_state` entry in a linear's state dict;
- the attributes `tensor_model_parallel`, `partition_dim` (0: the output dimension is the split one,
  a "column" linear, the embedding and the head; 1: the input dimension, a "row" linear) and
  `partition_stride`, on every weight a tensor-parallel run splits (also at TP=1);
- the arithmetic `matmul(x, W^T)` then `+ b`, returned as `(output, bias)` (the bias is returned, not
  added, with `skip_bias_add`: sequence parallelism adds it itself).

So a TP=1 state dict loads into the multi-rank layers and back. The layers are allocated with
`torch.empty` (on the device of a surrounding `torch.device` context, in `params_dtype`) and left
uninitialised: model/init.py draws every weight.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def mark_split(p: torch.nn.Parameter, dim: int) -> None:
    """Record that tensor parallelism splits `p` along `dim` (the layout attributes above)."""
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1


class LocalLinear(torch.nn.Module):
    """`y = x W^T + b` returning `(output, output_bias)`; `split_dim` records which dimension a
    tensor-parallel run splits (0: column parallel, 1: row parallel)."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool, split_dim: int,
                 params_dtype: torch.dtype = torch.float32, skip_bias_add: bool = False):
        super().__init__()
        self.input_size, self.output_size, self.skip_bias_add = input_size, output_size, skip_bias_add
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype))
        mark_split(self.weight, split_dim)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(output_size, dtype=params_dtype))
            if split_dim == 0:
                mark_split(self.bias, 0)
        else:
            self.register_parameter("bias", None)

    def get_extra_state(self) -> Any:  # the state-dict entry the multi-rank linears save (None)
        return None

    def set_extra_state(self, state: Any) -> None:
        pass

    def forward(self, x: torch.Tensor):
        out = torch.matmul(x, self.weight.t())
        if self.bias is not None and not self.skip_bias_add:
            return out + self.bias, None
        return out, self.bias


class LocalEmbedding(torch.nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = torch.nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=params_dtype))
        mark_split(self.weight, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight)


class _CrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of fp32 logits [..., V], computed in place on them (the input is
    consumed, as the multi-rank loss consumes its slice). Its steps are those of the vocab-parallel
    loss over one rank (max, shift, gather the target logit, exp, sum, log; backward: softmax minus
    one at the target), so the two agree bit for bit; targets outside [0, V) contribute zero."""

    @staticmethod
    def forward(ctx, logits, target):
        logits = logits.float()
        logits -= logits.max(dim=-1)[0].unsqueeze(-1)
        outside = (target < 0) | (target >= logits.size(-1))
        target_1d = target.clone()
        target_1d[outside] = 0
        target_1d = target_1d.view(-1)
        logits_2d = logits.view(-1, logits.size(-1))
        rows = torch.arange(logits_2d.size(0), device=logits.device)
        predicted = logits_2d[rows, target_1d].clone().contiguous().view_as(target)
        predicted[outside] = 0.0
        exp = torch.exp(logits, out=logits)
        sum_exp = exp.sum(dim=-1)
        loss = torch.log(sum_exp) - predicted
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, outside, target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, outside, target_1d = ctx.saved_tensors
        grad_2d = softmax.view(-1, softmax.size(-1))
        rows = torch.arange(grad_2d.size(0), device=grad_2d.device)
        grad_2d[rows, target_1d] -= 1.0 - outside.view(-1).float()
        softmax.mul_(grad_output.unsqueeze(-1))
        return softmax, None


def vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy of full-vocabulary logits [..., V] (in place on an fp32 input)."""
    return _CrossEntropy.apply(logits, target)


class TensorParallel:
    """One process: the whole model on this rank. Subclasses split it over `size` ranks.

    Communication methods take and return activations; each is the identity here."""

    size = 1
    rank = 0
    sequence_parallel = False

    def __init__(self, params_dtype: torch.dtype = torch.float32):
        self.params_dtype = params_dtype

    # -- layers ------------------------------------------------------------------------------------
    def column_linear(self, input_size: int, output_size: int, *, bias: bool) -> torch.nn.Module:
        """Output dimension split over the ranks (the input arrives whole on each)."""
        return LocalLinear(input_size, output_size, bias=bias, split_dim=0, params_dtype=self.params_dtype)

    def row_linear(self, input_size: int, output_size: int, *, bias: bool, skip_bias_add: bool = False) -> torch.nn.Module:
        """Input dimension split over the ranks, output summed over them."""
        return LocalLinear(input_size, output_size, bias=bias, split_dim=1, params_dtype=self.params_dtype,
                           skip_bias_add=skip_bias_add)

    def vocab_embedding(self, num_embeddings: int, embedding_dim: int) -> torch.nn.Module:
        """Vocabulary split over the ranks."""
        return LocalEmbedding(num_embeddings, embedding_dim, params_dtype=self.params_dtype)

    def vocab_head(self, hidden: int, vocab: int, *, bias: bool) -> torch.nn.Module:
        """The untied output head: vocabulary split over the ranks, run on the whole sequence."""
        return self.column_linear(hidden, vocab, bias=bias)

    # -- communication -----------------------------------------------------------------------------
    def all_reduce_grad(self, x: torch.Tensor) -> torch.Tensor:
        """`x` used whole by every rank on its own part of the work (a replicated weight on a slice of
        the sequence or of the heads, the tied head's input): identity forward, gradient summed over
        the ranks backward, so replicas stay equal."""
        return x

    def scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[T, B, H] -> this rank's slice of the sequence (sequence parallelism)."""
        return x

    def gather_sequence(self, x: torch.Tensor, reduce_grad: bool = False) -> torch.Tensor:
        """This rank's slice of the sequence -> [T, B, H]; the backward splits the (already complete)
        gradient without reducing it, or with `reduce_grad` (each rank's gradient is a part of the sum,
        as behind a column-parallel linear) reduce-scatters it."""
        return x

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's partial result -> their sum on every rank (forward all-reduce, identity backward:
        the output of a row-parallel linear)."""
        return x

    def reduce_scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's partial [T, B, H] -> this rank's slice of the sequence of the sum (a row-parallel
        linear's output under sequence parallelism; all-gather backward)."""
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Vocab-split logits [..., V/size] -> [..., V]."""
        return logits

    def dropout_rng(self):
        """The random stream dropout draws from on a slice of the sequence (different per rank)."""
        return contextlib.nullcontext()

    def cross_entropy(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy of vocab-split logits [..., V/size] (in place on an fp32 input)."""
        return vocab_cross_entropy(logits, target)


__all__ = ["LocalEmbedding", "LocalLinear", "TensorParallel", "mark_split", "vocab_cross_entropy"]
