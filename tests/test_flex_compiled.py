"""The compiled flex-attention kernel (what model/flex.py runs on CUDA) on the CPU through inductor, at a
length where the block masks have several tiles, full and partial, and whole tiles are skipped: for every
mask kind it equals SDPA with the dense mask (model/masks.py) computed in float64, with grouped-query
attention. The CPU tests of test_flex_attention.py run flex eagerly, which computes the full score
matrix and never reads the block-sparse tile metadata; this kernel does.

Also: `train.compile` with the flex backend on the CPU is refused in one line naming the keys, because
inductor's CPU flex kernel ignores a view operand's offset (pretrain/block_compile.py, docs/gpu.md),
and the CLI turns that into exit status 2 before any training.
"""

import pytest
import torch
import torch.nn.functional as F

from model import flex
from model.config import ModelConfig
from model.masks import build_mask
from model.transformer import Transformer

pytestmark = pytest.mark.skipif(not flex.available(), reason="torch has no flex attention")

L = 320  # two-stream kinds: T = 640, five 128-token tiles a side; the single-stream ones end in a partial tile
KINDS = [("causal", 0), ("bidirectional", 0), ("set_causal", 0), ("block_diffusion", 64)]


@pytest.fixture(scope="module")
def compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    from pretrain.block_compile import compile_unavailable

    why = compile_unavailable(torch.device("cpu"))
    if why:
        pytest.skip(why)
    return torch.compile(flex_attention, dynamic=False)


@pytest.mark.parametrize("kind,bs", KINDS)
def test_compiled_flex_equals_dense_attention_at_320(compiled_flex, kind, bs):
    T = L if kind in ("causal", "bidirectional") else 2 * L
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, T, 16, generator=g)
    k, v = (torch.randn(1, 2, T, 16, generator=g) for _ in range(2))  # 2 query heads per KV head
    bm = flex.block_mask(kind, L, bs, "cpu")
    tiles = -(-T // bm.BLOCK_SIZE[0])
    assert bm.kv_num_blocks.shape[-1] == tiles >= 3
    if kind != "bidirectional":  # whole tiles are skipped: the kernel must read the sparse metadata right
        assert int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum()) < tiles * tiles
    out = compiled_flex(q, k, v, block_mask=bm, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=build_mask(kind, L, bs),
                                         enable_gqa=True)
    err = float((out.double() - ref).norm() / ref.norm())
    assert out.dtype == torch.float32 and err < 1e-5, f"{kind}: compiled flex relative error {err:.2e}"


def test_train_compile_with_flex_is_refused_on_the_cpu():
    from pretrain.block_compile import CpuFlexCompileError, apply_compile

    cfg = ModelConfig(n_layers=1, hidden=32, n_heads=2, ffn_hidden=64, vocab_size=50, mask_id=49,
                      attention_backend="flex")
    model = Transformer(cfg)
    with pytest.raises(CpuFlexCompileError, match=r"train\.compile.*model\.attention_backend: flex") as e:
        apply_compile(model, torch.device("cpu"))
    assert "\n" not in str(e.value)
    assert not any(getattr(b, "_compiled_call_impl", None) for b in model.layers.values())
    cfg.attention_backend = "auto"  # SDPA on the CPU: not refused (the blocks compile at their first call)
    note = apply_compile(model, torch.device("cpu"))
    assert "compiled" in note or "eager" in note, note


@pytest.mark.slow
def test_the_cli_refuses_compile_with_flex_on_the_cpu_in_one_line(tmp_path):
    from helpers import setdlm, write_recipe

    r = setdlm("pretrain", "--config", write_recipe(tmp_path / "r.yaml"), "--out", tmp_path / "runs",
               "train.compile=true", "model.attention_backend=flex")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("setdlm pretrain: error:")]
    assert len(errors) == 1 and "train.compile" in errors[0] and "model.attention_backend" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and not any((tmp_path / "runs").glob("*/checkpoints/*"))
