"""The compiled decode step (SamplingConfig.compile: torch.compile here; CUDA graphs on a GPU) gives
exactly the eager path's greedy tokens. Inductor compiles on CPU are slow: one small shape per family."""

import pytest
import torch

from model.sampling import Infill, SamplingConfig, generate
from model.sampling.testing import tiny_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], Infill([1, 2], 6, [3, 4]), [9]]


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model(seed=0)


def _key(outs):
    return [(o.tokens, o.commit_step, o.steps, o.stop_reason) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("family,kw", [("setdlm", dict(window=4, threshold=0.6)), ("bd3lm", dict(block_size=4)),
                                        ("ar", {})])
def test_compiled_equals_eager(model, family, kw):
    # two slots over four prompts (slots are refilled under the compiled step); compact=False keeps one
    # batch shape, so one compile per family
    cfg = SamplingConfig(family=family, max_new_tokens=8, max_batch=2, compact=False, **kw)
    eager = generate(model, PROMPTS, cfg)
    compiled = generate(model, PROMPTS, cfg, compile=True)
    assert _key(compiled) == _key(eager)


@pytest.mark.slow
def test_compiled_overflow_equals_eager():
    """Past max_seq_len the compiled step drops the oldest cache entries as the eager one does."""
    m = tiny_model(seed=0, max_seq_len=16)
    prompts = [list(range(1, 15)), [4, 5, 6], Infill([1, 2, 3], 14, [7, 8])]
    cfg = SamplingConfig(family="setdlm", window=4, threshold=0.6, max_new_tokens=20, max_batch=2, compact=False)
    assert _key(generate(m, prompts, cfg, compile=True)) == _key(generate(m, prompts, cfg))


def test_compile_refused_for_mdlm():
    with pytest.raises(ValueError, match="sampling.compile"):
        SamplingConfig(family="mdlm", compile=True).validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA-graph decode step)")
@pytest.mark.parametrize("family,kw", [("setdlm", dict(window=4, threshold=0.6)), ("bd3lm", dict(block_size=4)),
                                        ("ar", {})])
def test_cuda_graph_step_equals_eager(family, kw):
    """On a GPU, compile=True captures the step in a CUDA graph (refills keep it, shrinking recaptures)."""
    from model.sampling.api import decoder_class
    from model.sampling.engine import to_requests

    m = tiny_model(seed=0).cuda()
    prompts = PROMPTS * 3
    cfg = SamplingConfig(family=family, max_new_tokens=8, max_batch=4, **kw)
    eager = generate(m, prompts, cfg)
    compiled = generate(m, prompts, cfg, compile=True)
    assert _key(compiled) == _key(eager)
    c = SamplingConfig(family=family, max_new_tokens=8, max_batch=4, compile=True, **kw)
    dec = decoder_class(family)(m, to_requests(prompts, c, m.cfg.mask_id, m.cfg.vocab_size), c,
                                mask_id=m.cfg.mask_id, eos_id=None)
    with torch.inference_mode():
        dec.run()
    assert dec.runner.mode == "cudagraph"
