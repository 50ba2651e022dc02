"""Context parallelism in one process (float64, exact): the head-tail split, the exchanged stream, the
rank-local masks and each rank's slice of a prepared batch (model/context_parallel.py,
Objective.for_rank). The multi-process runs are tests/test_context_parallel_runs.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.schema import ConfigError
from model import flex
from model.config import ModelConfig, ObjectiveConfig
from model.context_parallel import STREAMS, ContextParallel, RankLayout, check_layout, chunk_positions, to_stream_order
from model import families
from model.masks import build_mask, with_key_padding
from model.objectives import build_objective

L = 16
BLOCK = 2
KINDS = list(STREAMS)
FAMILY_KIND = {name: families.get(name).mask_kind for name in families.names()}


def _layouts(kind: str, cp: int) -> list[RankLayout]:
    return [RankLayout(kind, L, cp, r, BLOCK if kind == "block_diffusion" else 0) for r in range(cp)]


def test_head_tail_chunks_cover_the_sequence_once():
    for cp in (1, 2, 4):
        pos = torch.cat([chunk_positions(L, cp, r) for r in range(cp)])
        assert torch.equal(pos.sort().values, torch.arange(L))
    assert chunk_positions(16, 4, 1).tolist() == [2, 3, 12, 13]  # chunks 1 and 2*4-1-1 = 6 of 8


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_rank_rows_reproduce_the_full_attention(kind, cp):
    """Every rank's rows, from its own queries, its local keys and the exchanged stream gathered from all
    ranks (in the order `to_stream_order` puts it), equal the one-process attention's rows."""
    layouts = _layouts(kind, cp)
    T = STREAMS[kind][0] * L
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, T, 8, dtype=torch.float64, generator=g) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=build_mask(kind, L, layouts[0].block_size))
    xs = layouts[0].exchanged_tokens()
    sent = torch.stack([torch.stack((k[:, :, lay.token_index()][:, :, xs], v[:, :, lay.token_index()][:, :, xs]))
                        for lay in layouts])  # what every rank puts into the all-gather
    gathered = to_stream_order(sent)
    ex = layouts[0].exchanged
    assert torch.equal(gathered[0], k[:, :, ex * L:(ex + 1) * L])  # the whole exchanged stream, in order
    for lay in layouts:
        rows = lay.token_index()
        kl, vl = k[:, :, rows], v[:, :, rows]
        keys = torch.cat((kl[:, :, :xs.start], gathered[0], kl[:, :, xs.stop:]), 2)
        vals = torch.cat((vl[:, :, :xs.start], gathered[1], vl[:, :, xs.stop:]), 2)
        assert torch.equal(keys, k[:, :, lay.key_index()])
        assert torch.equal(lay.mask(), build_mask(kind, L, lay.block_size)[rows][:, lay.key_index()])
        out = F.scaled_dot_product_attention(q[:, :, rows], keys, vals, attn_mask=lay.mask())
        torch.testing.assert_close(out, full[:, :, rows], atol=1e-14, rtol=0)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kind", ["set_causal", "block_diffusion"])
def test_no_rank_needs_another_ranks_local_stream(kind, cp):
    """Two-stream masks: a rank's rows allow no key of the non-exchanged stream held by another rank, so
    only one stream (L tokens of K/V, not 2L) crosses ranks."""
    mask = build_mask(kind, L, BLOCK if kind == "block_diffusion" else 0)
    local_stream = 1 - STREAMS[kind][1]
    for lay in _layouts(kind, cp):
        others = torch.ones(L, dtype=torch.bool)
        others[lay.positions()] = False
        cols = local_stream * L + torch.arange(L)[others]
        assert not mask[lay.token_index()][:, cols].any()


def test_block_diffusion_needs_whole_blocks_per_chunk():
    """With chunks that cut a block, a noisy row would need noisy keys of another rank: refused."""
    mask = build_mask("block_diffusion", 12, 4)
    pos = chunk_positions(12, 2, 0)  # chunks of 3 tokens cut the 4-token blocks
    others = torch.ones(12, dtype=torch.bool)
    others[pos] = False
    assert mask[pos][:, torch.arange(12)[others]].any()
    with pytest.raises(ConfigError, match=r"parallel.cp: a chunk of data.seq_len / \(2 \* cp\) = 3 tokens is not a "
                                          r"multiple of objective.block_size=4"):
        check_layout("block_diffusion", 12, 2, 4)
    with pytest.raises(ConfigError, match=r"parallel.cp: data.seq_len=12 is not divisible by 2 \* cp = 8"):
        check_layout("set_causal", 12, 4)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_every_rank_gets_the_same_attention_work(kind, cp):
    pairs = [lay.pairs() for lay in _layouts(kind, cp)]
    total = int(build_mask(kind, L, BLOCK if kind == "block_diffusion" else 0).sum())
    assert pairs == [total // cp] * cp, pairs
    if kind == "set_causal":
        assert pairs[0] == (L * L + L) // cp  # clean causal + query-to-earlier-clean + query-to-itself


class _Rank(ContextParallel):
    def __init__(self, size, rank):
        self.size, self.rank = size, rank


def _objective(name: str, cp: ContextParallel | None = None):
    cfg = ModelConfig(n_layers=1, hidden=16, n_heads=2, ffn_hidden=32, vocab_size=50, mask_id=49, max_seq_len=64)
    obj = build_objective(ObjectiveConfig(name=name, set_size=4, block_size=BLOCK), cfg, L, context=cp)
    return obj


def _batch(padded: bool) -> dict:
    g = torch.Generator().manual_seed(3)
    batch = {"input_ids": torch.randint(0, 49, (3, L), generator=g)}
    if padded:  # prompt/answer rows: a context prefix and padding at the end (per-row key masks)
        valid = torch.arange(L)[None] < torch.tensor([[L], [L - 5], [L - 9]])
        batch.update(valid_mask=valid, context_mask=torch.arange(L)[None].expand(3, L) < 3)
    return batch


@pytest.mark.parametrize("padded", [False, True], ids=["static", "padded"])
@pytest.mark.parametrize("bound", [False, True], ids=["train", "bound"])
@pytest.mark.parametrize("family", list(FAMILY_KIND))
def test_each_rank_prepares_its_slice_of_the_whole_batch(family, bound, padded):
    """prepare under CP: every rank draws the whole sample (same orders and noise) and keeps its tokens,
    rotary positions, rank-local mask, and the targets and weights of its predictions; summed over the
    ranks, the loss weights, NLL weights and token counts are the whole batch's."""
    cp = 2
    full = _objective(family).prepare(_batch(padded), torch.Generator().manual_seed(5), bound=bound)
    parts = [_objective(family, _Rank(cp, r)).prepare(_batch(padded), torch.Generator().manual_seed(5), bound=bound)
             for r in range(cp)]
    kind = FAMILY_KIND[family]
    full_mask = full.attn_mask
    for r, part in enumerate(parts):
        lay = part.context
        assert lay == RankLayout(kind, L, cp, r, BLOCK if family == "bd3lm" else 0)
        rows = lay.token_index()
        assert torch.equal(part.input_ids, full.input_ids[:, rows])
        assert torch.equal(part.position_ids, full.position_ids[:, rows])
        assert torch.equal(part.attn_mask, full_mask[..., rows, :][..., lay.key_index()])
        assert (part.mask_spec is None) == (full.mask_spec is None)
        out = torch.arange(part.logits_slice.start, part.logits_slice.stop)
        assert torch.equal(rows[out] - full.logits_slice.start, lay.positions())  # outputs: its predicted-stream tokens
    for key in ("loss_weight", "nll_weight"):
        assert sum(float(getattr(p, key).sum()) for p in parts) == pytest.approx(float(getattr(full, key).sum()), rel=1e-6)
    assert sum(float(p.num_tokens) for p in parts) == float(full.num_tokens)
    # every prediction of the whole batch is made on exactly one rank, with the same target and weights
    for r, part in enumerate(parts):
        pos = part.context.positions()
        keep = pos < full.targets.shape[1]
        assert torch.equal(part.targets[:, keep], full.targets[:, pos[keep]])
        assert torch.equal(part.loss_weight[:, keep], full.loss_weight[:, pos[keep]])
        assert not part.loss_weight[:, ~keep].any() and not part.nll_weight[:, ~keep].any()


@pytest.mark.parametrize("family", list(FAMILY_KIND))
def test_rank_losses_sum_to_the_one_process_loss(family):
    """A tiny model's per-token CE on each rank (its tokens, the exchanged K/V of every rank, its local
    mask) sums over the ranks to the one-process CE sum: the forward of CP in one process."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=50, mask_id=49,
                      dropout=0.0, max_seq_len=64, norm="rmsnorm", activation="swiglu", qk_norm=True)
    from model.transformer import Transformer

    model = Transformer(cfg).double().eval()
    cp = 4
    full = _objective(family).prepare(_batch(False), torch.Generator().manual_seed(5))
    parts = [_objective(family, _Rank(cp, r)).prepare(_batch(False), torch.Generator().manual_seed(5)) for r in range(cp)]
    with torch.no_grad():
        logits = model(full.input_ids, full.position_ids, **full.model_kwargs())
        ref = _objective(family).loss(logits.clone(), full)[1]
        kv = _LockstepKV(model, parts)
        got = [kv.rank_loss(r) for r in range(cp)]
    for r, part in enumerate(parts):  # (float64 model; the head's logits are float32)
        pos = part.context.positions()
        keep = pos < logits.shape[1]
        torch.testing.assert_close(kv.logits[r][:, keep], logits[:, pos[keep]], rtol=1e-6, atol=1e-6)
    assert sum(float(m["loss_sum"]) for m in got) == pytest.approx(float(ref["loss_sum"]), rel=1e-6)
    assert sum(float(m["loss_count"]) for m in got) == float(ref["loss_count"])


class _LockstepKV:
    """Runs the ranks' forwards layer by layer in one process: each layer's exchanged K/V are taken
    from every rank's input to that layer (what the all-gather hands each rank)."""

    def __init__(self, model, parts):
        self.model, self.parts = model, parts
        self.hidden = [model.embed_tokens(p.input_ids) for p in parts]
        self.ropes = [model.rotary(p.position_ids) for p in parts]
        self.logits = [None] * len(parts)
        for block in model.layers.values():
            self._layer(block)
        for r, part in enumerate(parts):
            x = self.hidden[r][:, part.logits_slice]
            self.logits[r] = model.output_logits(x)

    def _layer(self, block):
        parts, cp = self.parts, len(self.parts)
        sent = []
        for r in range(cp):  # each rank's K/V of the exchanged stream at this layer
            k, v = self._kv(block, r)
            xs = parts[r].context.exchanged_tokens()
            sent.append(torch.stack((k[:, :, xs], v[:, :, xs])))
        stacked = torch.stack(sent)
        for r in range(cp):
            block.attn.cp = _Gathered(stacked, cp, r)
            self.hidden[r] = block(self.hidden[r], self.ropes[r], parts[r].attn_mask, None, parts[r].context)
            block.attn.cp = ContextParallel()

    def _kv(self, block, r):
        attn, x = block.attn, block.norm1(self.hidden[r])
        B, T = x.shape[:2]
        qkv = attn.qkv(x)[0].reshape(B, T, attn.groups, attn.q_per_group + 2, attn.head_dim)
        k, v = qkv[:, :, :, -2].transpose(1, 2), qkv[:, :, :, -1].transpose(1, 2)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        from model.rotary import apply_rotary

        cos, sin = self.ropes[r]
        return apply_rotary(k, cos, sin), v

    def rank_loss(self, r):
        part = self.parts[r]
        return _objective(self._family(part)).loss(self.logits[r].clone(), part)[1]

    @staticmethod
    def _family(part):
        return {v: k for k, v in FAMILY_KIND.items()}[part.context.kind]


class _Gathered(ContextParallel):
    def __init__(self, stacked, size, rank):
        self.stacked, self.size, self.rank = stacked, size, rank

    def all_gather(self, x):
        assert torch.equal(x, self.stacked[self.rank])  # this rank's own contribution
        return self.stacked


@pytest.mark.skipif(not flex.available(), reason="torch has no flex attention")
@pytest.mark.parametrize("kind", ["set_causal", "block_diffusion"])
def test_flex_block_mask_of_a_rank_equals_its_dense_mask(kind):
    """The GPU path's rank-local flex block mask: forward on CPU equals SDPA under the dense local mask."""
    lay = _layouts(kind, 2)[1]
    rows, cols = lay.token_index(), lay.key_index()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, rows.numel(), 8, generator=g)
    k, v = (torch.randn(1, 2, cols.numel(), 8, generator=g) for _ in range(2))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=lay.mask())
    fast = flex.attend(q, k, v, lay.block_mask("cpu"))
    torch.testing.assert_close(fast, dense, atol=1e-5, rtol=1e-5)


def test_padded_local_mask_keeps_every_row_non_empty():
    """A per-row key mask cut to a rank keeps each row's own key (with_key_padding's diagonal): no row
    whose keys are all padding is empty on any rank."""
    valid = torch.arange(L)[None] < torch.tensor([[4]])
    full = with_key_padding(build_mask("set_causal", L), torch.cat((valid, valid), 1))
    for lay in _layouts("set_causal", 4):
        assert lay.slice_mask(full).any(-1).all()


@pytest.mark.parametrize("overrides,message", [
    (["parallel.cp=3"], "parallel.cp: data.seq_len=32 is not divisible by 2 * cp = 6"),
    (["parallel.cp=2", "objective.name=bd3lm", "objective.block_size=16"],
     "parallel.cp: a chunk of data.seq_len / (2 * cp) = 8 tokens is not a multiple of objective.block_size=16"),
    (["parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true", "model.n_heads=4", "objective.name=ar",
      "data.seq_len=20"],
     "parallel.sequence_parallel: 10 tokens per sequence on each of the parallel.cp=2 ranks through the model are "
     "not divisible by parallel.tp=4"),
])
def test_bad_cp_layouts_are_one_line_errors(tmp_path, capsys, overrides, message):
    from helpers import write_recipe
    from launch.cli import main as cli_main

    recipe = write_recipe(tmp_path / "r.yaml")
    code = cli_main(["pretrain", "--config", str(recipe), "--out", str(tmp_path / "runs"), *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and message in err, err
    assert not (tmp_path / "runs").exists()
