"""The model's one-process layers (model/layers.py) are megatron-core's tensor-parallel layers at TP=1,
exactly, as pretrain/tensor_parallel.py builds them.

They hold the same parameters (names, shapes, layout attributes, state-dict entries, so a state dict
moves between them in both directions), and with the same weights they give bit-identical outputs
and gradients; the model's cross-entropy is megatron's vocab-parallel one over one rank, bit for bit.
So a TP=1 model trains and checkpoints as it would on megatron's layers, and loads into megatron's
TP>1 layers and back."""

from __future__ import annotations

import pytest
import torch
from megatron.core import tensor_parallel

from model import layers
from pretrain.tensor_parallel import MegatronTensorParallel

LAYOUT = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _build(tp, kind: str):
    if kind == "column":
        return tp.column_linear(16, 24, bias=True)
    if kind == "row":
        return tp.row_linear(16, 24, bias=True)
    if kind == "head":
        return tp.vocab_head(16, 24, bias=True)
    return tp.vocab_embedding(40, 16)


@pytest.mark.parametrize("kind", ["column", "row", "head", "embedding"])
def test_tp1_layers_equal_megatron(model_parallel, kind):
    ref = _build(MegatronTensorParallel(1), kind)  # megatron's layers (built over a group of one)
    got = _build(layers.TensorParallel(), kind)
    assert type(ref).__module__.startswith("megatron") and not isinstance(got, type(ref))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    a = ref.state_dict()
    got.load_state_dict(a, strict=True)  # megatron -> plain, every entry (`_extra_state` too)
    b = got.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))
    ref.load_state_dict(b, strict=True)  # and back
    params = dict(got.named_parameters())
    assert params.keys() == dict(ref.named_parameters()).keys()
    for name, p in ref.named_parameters():
        assert [getattr(p, k, None) for k in LAYOUT] == [getattr(params[name], k, None) for k in LAYOUT], name
        assert p.dtype == params[name].dtype and p.shape == params[name].shape, name
    if kind == "embedding":
        x = torch.randint(0, 40, (3, 5))
        ya, yb = ref(x), got(x)
    else:
        x = torch.randn(3, 5, 16, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        (ya, _), (yb, _) = ref(x), got(x2)
    assert torch.equal(ya, yb)
    (ya ** 2).sum().backward()
    (yb ** 2).sum().backward()
    for name, p in ref.named_parameters():
        assert torch.equal(p.grad, params[name].grad), name
    if kind != "embedding":
        assert torch.equal(x.grad, x2.grad)


def test_tp1_cross_entropy_equals_megatron(model_parallel):
    """The model's cross-entropy (its one-process `TensorParallel`) is megatron's, bit for bit, in loss
    and gradient, with -inf logits (MASK, padding) as the model produces them."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 40, generator=g) * 3
    logits[..., 37:] = float("-inf")
    target = torch.randint(0, 37, (3, 7), generator=g)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    ref = tensor_parallel.vocab_parallel_cross_entropy(a.clone(), target)
    got = layers.TensorParallel().cross_entropy(b.clone(), target)
    assert torch.equal(ref, got)
    w = torch.rand(3, 7, generator=g)
    (ref * w).sum().backward()
    (got * w).sum().backward()
    assert torch.equal(a.grad, b.grad)
    assert torch.allclose(got, torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none"),
                          atol=1e-5)
    assert torch.equal(MegatronTensorParallel(1).cross_entropy(logits.clone(), target), ref)
