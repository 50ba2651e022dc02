"""Cached decoding on CUDA equals the recomputing reference for every family (greedy: same tokens,
same commit steps), eager and with the compiled decode step."""

import pytest
import torch

from model.sampling import Infill, SamplingConfig, generate
from model.sampling.reference import generate_reference
from model.sampling.testing import tiny_model

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (none is visible)")]

MODES = [False, True]
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16]]
INFILL = [Infill([1, 2, 3], 6, [7, 8, 9]), Infill([4], 9, [5, 6])]
CASES = [("setdlm", dict(window=4)), ("setdlm", dict(window=4, threshold=0.6)), ("setdlm", dict(window=8, threshold=0.0)),
         ("bd3lm", dict(block_size=4)), ("bd3lm", dict(block_size=4, threshold=0.6)), ("ar", {})]


@pytest.fixture(scope="module")
def cuda_model():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield tiny_model(seed=1).cuda()
    torch.backends.cuda.matmul.allow_tf32 = saved


def _key(outs):
    return [(o.tokens, o.commit_step, o.steps, o.sequence) for o in outs]


def _cfg(family, kw, compiled, **more):
    return SamplingConfig(family=family, stop_on_eos=False, compile=compiled, **kw, **more)


@pytest.mark.parametrize("compiled", MODES, ids=lambda c: "compiled" if c else "eager")
@pytest.mark.parametrize("family,kw", CASES, ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}={v}" for k, v in x.items()))
def test_cached_decoding_matches_reference_on_cuda(cuda_model, family, kw, compiled):
    cfg = _cfg(family, kw, compiled, max_new_tokens=11)
    for prompts in (PROMPTS, INFILL):
        out = generate(cuda_model, prompts, cfg)
        assert _key(out) == _key(generate_reference(cuda_model, prompts, cfg)), (family, kw, compiled)
    assert next(cuda_model.parameters()).is_cuda


def test_mdlm_batch_equals_one_by_one_on_cuda(cuda_model):
    """MDLM has no recomputing reference (it has no cache) and decodes eagerly only: a batch equals
    each prompt alone."""
    cfg = _cfg("mdlm", dict(steps=5), False, max_new_tokens=10)
    prompts = PROMPTS + INFILL
    assert _key(generate(cuda_model, prompts, cfg)) == [_key(generate(cuda_model, [p], cfg))[0] for p in prompts]


def test_cuda_equals_cpu_tokens():
    """The same weights decode the same greedy tokens on CUDA as on the CPU (the CPU tests' ground truth)."""
    cpu = tiny_model(seed=2)
    gpu_model = tiny_model(seed=2).cuda()
    for family, kw in CASES[:1] + CASES[3:]:
        cfg = _cfg(family, kw, False, max_new_tokens=9)
        assert _key(generate(gpu_model, PROMPTS, cfg)) == _key(generate(cpu, PROMPTS, cfg)), family
