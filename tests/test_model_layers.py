"""model/layers.py: at TP=1 the plain torch layers are megatron-core's layers, exactly.

Built after the same seed they hold the same parameters (names, values, layout attributes, state-dict
entries), and give bit-identical outputs and gradients; so a TP=1 model trains and checkpoints as it
did on megatron's layers, and loads into megatron's TP>1 layers and back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core import tensor_parallel

from model import layers
from model.transformer import _init, megatron_config

LAYOUT = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _megatron(kind: str, mp):
    if kind == "column":
        return tensor_parallel.ColumnParallelLinear(16, 24, config=mp, init_method=_init(0.5), bias=True, gather_output=False)
    if kind == "row":
        return tensor_parallel.RowParallelLinear(16, 24, config=mp, init_method=_init(0.5), bias=True,
                                                 input_is_parallel=True, skip_bias_add=False)
    return tensor_parallel.VocabParallelEmbedding(40, 16, init_method=_init(0.5), config=mp)


def _local(kind: str, mp):
    if kind == "column":
        return layers.column_linear(16, 24, config=mp, init_method=_init(0.5), bias=True)
    if kind == "row":
        return layers.row_linear(16, 24, config=mp, init_method=_init(0.5), bias=True)
    return layers.vocab_embedding(40, 16, init_method=_init(0.5), config=mp)


@pytest.mark.parametrize("kind", ["column", "row", "embedding"])
def test_tp1_layers_equal_megatron(model_parallel, kind):
    # the model itself initialises per shard (model/init.py); here both layer kinds draw their own weights
    mp = dataclasses.replace(megatron_config(), perform_initialization=True)
    torch.manual_seed(3)
    ref = _megatron(kind, mp)
    torch.manual_seed(3)
    got = _local(kind, mp)
    assert not isinstance(got, type(ref))
    a, b = ref.state_dict(), got.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))
    params = dict(got.named_parameters())
    for name, p in ref.named_parameters():
        assert [getattr(p, k, None) for k in LAYOUT] == [getattr(params[name], k, None) for k in LAYOUT], name
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
    """The local cross-entropy (used when there is no TP group of size > 1) is megatron's, bit for bit,
    in loss and gradient, with -inf logits (MASK, padding) as the model produces them."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 40, generator=g) * 3
    logits[..., 37:] = float("-inf")
    target = torch.randint(0, 37, (3, 7), generator=g)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    ref = tensor_parallel.vocab_parallel_cross_entropy(a.clone(), target)
    got = layers._LocalCrossEntropy.apply(b.clone(), target)
    assert torch.equal(ref, got)
    w = torch.rand(3, 7, generator=g)
    (ref * w).sum().backward()
    (got * w).sum().backward()
    assert torch.equal(a.grad, b.grad)
    assert torch.allclose(got, torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none"),
                          atol=1e-5)
