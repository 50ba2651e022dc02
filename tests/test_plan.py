"""`setdlm pretrain --dry-run`: layout validation, process groups, memory and FLOPs, nothing started."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import write_recipe
from launch.cli import main as cli_main
from pretrain.config import load_config
from pretrain.memory import bytes_per_param, estimate_memory, stage_params
from pretrain.plan import plan, rank_groups


def test_dry_run_of_a_64_gpu_layout(tmp_path, capsys):
    code = cli_main(["pretrain", "--config", "configs/qwen3-1.7b-setdlm.yaml", "--dry-run", "--world-size", "64",
                     "--out", str(tmp_path), "parallel.tp=8", "parallel.pp=4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "world 64 = TP 8 x PP 4 x DP 2" in out
    assert "stage 3: layers 21-27, final norm + head + loss (tied embedding copy)" in out
    assert "memory per GPU" in out and "FLOPs per step" in out and "communication per step" in out
    # rank 17: node 2, stage 1, TP group 16..23, PP group 1,17,33,49, DP group 17,25
    row = next(line for line in out.splitlines() if line.split()[:1] == ["17"])
    assert row.split()[:6] == ["17", "2", "1", "16..23", "1..49", "step"], row
    assert "17,25" in row
    assert "nothing was started" in out
    assert not any(tmp_path.iterdir())  # no run directory, no checkpoints


def test_groups_partition_the_world():
    tp, pp, dp = 2, 4, 3
    g = rank_groups(tp, pp, dp)
    world = set(range(tp * pp * dp))
    for name, size in (("tp", tp), ("pp", pp), ("dp", dp), ("mp", tp * pp)):
        members = [r for group in g[name] for r in group]
        assert sorted(members) == sorted(world) and all(len(x) == size for x in g[name]), name
    assert all(group == list(range(group[0], group[0] + tp)) for group in g["tp"])  # TP peers are neighbours
    assert all(e == [p[0], p[-1]] for e, p in zip(g["embedding"], g["pp"]))


@pytest.mark.parametrize("variant", [
    dict(tie_embeddings=True, norm="rmsnorm", activation="swiglu", qk_norm=True, bias=False, n_kv_heads=2),
    dict(tie_embeddings=False, norm="layernorm", activation="gelu", bias=True, head_bias=True),
])
def test_parameter_counts_match_the_built_stages(tmp_path, variant):
    from model.transformer import Transformer
    from pretrain.parallelize import stage_layers

    cfg = load_config(write_recipe(tmp_path / "r.yaml", model={"n_layers": 5, "n_heads": 4, **variant}),
                      ["model.vocab_size=300", "model.mask_id=299"])
    pp = 3
    for sp in stage_params(cfg.model, pp):
        stage = Transformer(cfg.model, pre_process=sp.stage == 0, post_process=sp.stage == pp - 1,
                            layers=stage_layers(cfg.model.n_layers, pp, sp.stage))
        sharded = sum(p.numel() for p in stage.parameters() if getattr(p, "tensor_model_parallel", False))
        replicated = sum(p.numel() for p in stage.parameters() if not getattr(p, "tensor_model_parallel", False))
        assert (sp.sharded + sp.copies, sp.replicated) == (sharded, replicated), sp.stage


def test_zero_stages_shard_what_they_should():
    z = [bytes_per_param("bf16", s, 8) for s in range(4)]
    assert z[0] == {"weights": 2, "grads": 6, "optimizer": 12}
    assert z[1]["optimizer"] == 12 / 8 and z[1]["grads"] == 2 + 4 / 8 and z[1]["weights"] == 2
    assert z[2]["grads"] == 6 / 8 and z[3]["weights"] == 2 / 8
    assert bytes_per_param("fp32", 0, 1) == {"weights": 4, "grads": 4, "optimizer": 8}
    assert bytes_per_param("fp32", 1, 2) == {"weights": 4, "grads": 4 + 2, "optimizer": 6}


def test_pipeline_stages_hold_fewer_micro_batches_downstream(tmp_path):
    cfg = load_config(write_recipe(tmp_path / "r.yaml", model={"n_layers": 4}),
                      ["model.vocab_size=300", "model.mask_id=299", "parallel.pp=4", "train.global_batch=32",
                       "train.micro_batch=2"])
    mem = estimate_memory(cfg, 4)
    assert [m.in_flight for m in mem] == [4, 3, 2, 1]
    assert mem[0].activations > mem[1].activations > mem[2].activations > mem[3].activations
    assert mem[3].logits > 0 and mem[0].logits == 0


@pytest.mark.parametrize("world,overrides,field", [
    (4, ["parallel.pp=2", "parallel.zero_stage=2"], "parallel.zero_stage"),
    (4, ["parallel.pp=2", "parallel.zero_stage=3"], "parallel.zero_stage"),
    (4, ["parallel.tp=2", "parallel.zero_stage=3"], "parallel.zero_stage"),
    (4, ["parallel.tp=3"], "parallel.tp"),
    (6, ["parallel.pp=4", "model.n_layers=4"], "parallel.tp/parallel.pp"),
    (4, ["parallel.tp=4", "model.n_heads=2", "model.hidden=32"], "model.n_heads"),
    (4, ["parallel.tp=2", "train.global_batch=6", "train.micro_batch=2"], "train.global_batch"),
    (4, ["parallel.pp=4", "model.n_layers=2"], "parallel.pp"),
])
def test_unsupported_layouts_fail_naming_the_field(tmp_path, capsys, world, overrides, field):
    recipe = write_recipe(tmp_path / "r.yaml")
    code = cli_main(["pretrain", "--config", str(recipe), "--dry-run", "--world-size", str(world), *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert field in err, err


def test_plan_needs_no_tokenizer_when_the_vocabulary_is_set(tmp_path):
    cfg = load_config(write_recipe(tmp_path / "r.yaml", data={"tokenizer": "/no/such/tokenizer"}),
                      ["model.vocab_size=300", "model.mask_id=299", "train.micro_batch=2"])
    info = plan(cfg, 2)
    assert info["dp"] == 2 and info["params_total"] > 0



def test_plan_loads_the_tokenizer_as_the_run_does(tmp_path, capsys):
    """An HF tokenizer directory without a mask token: planned with the MASK the run appends
    (data.add_mask_token), refused in one line naming the fix without it."""
    from model.convert.hf_testing import write_gpt2_tokenizer

    write_gpt2_tokenizer(tmp_path / "tok")
    recipe = write_recipe(tmp_path / "r.yaml", data={"tokenizer": str(tmp_path / "tok"), "add_mask_token": True},
                          model={"vocab_size": 0, "mask_id": -1})
    cfg = load_config(recipe, ["train.micro_batch=2"])
    assert plan(cfg, 2)["params_total"] > 0
    assert (cfg.model.vocab_size, cfg.model.mask_id) == (50258, 50257)
    assert cli_main(["pretrain", "--config", str(recipe), "--dry-run", "--world-size", "2", "train.micro_batch=2",
                     "data.add_mask_token=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.add_mask_token: true" in err[0] and "model.mask_id" in err[0], err

def test_checkpointing_and_sequence_parallel_shrink_activations(tmp_path):
    cfg = load_config("configs/qwen3-1.7b-setdlm.yaml", ["model.vocab_size=151936", "model.mask_id=151935"])
    acts = {mode: estimate_memory(cfg, 8, checkpointing=mode)[0].activations for mode in ("none", "selective", "full")}
    assert acts["none"] > acts["selective"] > acts["full"] > 0
    assert acts["full"] < 0.2 * acts["none"]
    cfg.parallel.sequence_parallel = True
    sp = estimate_memory(cfg, 8)[0].activations
    assert 0.5 * acts["none"] < sp < acts["none"]  # only the tensors outside the TP regions are split


def test_micro_batch_fit_answers_for_qwen3_on_80gb(tmp_path):
    from pretrain.memory import micro_batch_fit

    for seq_len, none_fits in ((1024, 16), (4096, 4)):
        cfg = load_config("configs/qwen3-1.7b-setdlm.yaml", ["model.vocab_size=151936", "model.mask_id=151935",
                                                             f"data.seq_len={seq_len}", "model.max_seq_len=4096"])
        fit = micro_batch_fit(cfg, 8, 80.0)
        assert fit["none"][0] == none_fits, fit
        assert fit["full"][0] > fit["none"][0] and all(pk <= 0.9 * 80 * 1024**3 for b, pk in fit.values() if b)


# -- activations: a hand count of what a block saves, eager and compiled -----------------------------------
GELU_LN = dict(hidden=8, n_heads=2, ffn_hidden=16, norm="layernorm", activation="gelu", bias=True)
SWIGLU_RMS = dict(hidden=8, n_heads=2, n_kv_heads=1, ffn_hidden=16, norm="rmsnorm", activation="swiglu",
                  qk_norm=True, bias=False)
QWEN3_GQA = dict(hidden=16, n_heads=4, n_kv_heads=2, ffn_hidden=24, norm="rmsnorm", activation="swiglu",
                 qk_norm=True, bias=False)


def _model(tmp_path, **model):
    return load_config(write_recipe(tmp_path / "r.yaml", model=model), ["model.vocab_size=300", "model.mask_id=299"]).model


# bytes per token (fp32, TP 1, CPU): h = 8, 2 heads of d = 4, ffn f = 16
#   GELU/LayerNorm eager none: norm inputs 2h + linear inputs 2h + qkv output (a + 2kv)d = 16 + q, k 8 + 8
#   + attention output 8 + proj input 8 + fc1 output 16 + fc2 input 16 = 120 elements = 480 bytes,
#   + LayerNorm mean/rstd 2 x 2 x 4 + log-sum-exp 2 x 4 = 504. Compiled none: the same (nothing pointwise
#   is saved). Selective: - attention output - log-sum-exp = 464; compiled selective also - fc2 input = 400.
#   SwiGLU/RMSNorm/QK-norm (1 kv head, so q is a view of qkv): eager (composite RMSNorm) 2 x 2h + 2h
#   + qkv (2 + 2) x 4 + q, k 12 + 8 + 8 + normalised q, k 12 + fc1 output 2f + silu(gate) f + fc2 input f
#   = 168 elements = 672 bytes + rstd 2 x 4 + QK-norm rstd 3 x 4 + lse 8 = 700; compiled: no x*rstd (2h),
#   no normalised q, k (12), no silu(gate) (f) -> 124 elements = 496 + 28 = 524. Selective: - attention
#   output, lse and silu(gate): 596; compiled: - attention output and fc2 input: 420.
@pytest.mark.parametrize("block,mode,eager,compiled", [
    (GELU_LN, "none", 504, 504), (GELU_LN, "selective", 464, 400), (GELU_LN, "full", 32, 32),
    (SWIGLU_RMS, "none", 700, 524), (SWIGLU_RMS, "selective", 596, 420),
])
def test_saved_bytes_per_token_match_a_hand_count(tmp_path, block, mode, eager, compiled):
    from pretrain.memory import activation_bytes_per_token_layer

    m = _model(tmp_path, **block)
    assert activation_bytes_per_token_layer(m, 1, 64, 4, "cpu", mode) == eager
    assert activation_bytes_per_token_layer(m, 1, 64, 4, "cpu", mode, compiled=True) == compiled


def test_compiled_backward_working_set_matches_a_hand_count(tmp_path):
    from pretrain.memory import backward_working_set

    m = _model(tmp_path, **GELU_LN)
    # eager: output gradient h + fc1-output gradient f = 24 elements; compiled: + fc2-input gradient f = 40;
    # compiled selective: + recomputed activation output f + attention output 8 = 64; full: + the block (504)
    ws = {(mode, c): backward_working_set(m, 1, 64, 4, "cpu", mode, compiled=c)
          for mode in ("none", "selective", "full") for c in (False, True)}
    assert ws[("none", False)] == ws[("selective", False)] == 96
    assert ws[("none", True)] == 160 and ws[("selective", True)] == 256
    assert ws[("full", False)] == 96 + 504 and ws[("full", True)] == 160 + 504
    # SwiGLU: fc1's output gradient is 2f wide; eager selective also holds the recomputed silu(gate) (f)
    m = _model(tmp_path, **SWIGLU_RMS)
    assert backward_working_set(m, 1, 64, 4, "cpu", "none") == (8 + 32) * 4
    assert backward_working_set(m, 1, 64, 4, "cpu", "selective") == (8 + 32 + 16) * 4


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_compiled_estimate_differs_from_eager_as_modelled(tmp_path, mode):
    """estimate_memory(train.compile) = eager + layers x tokens x (saved difference) + tokens x (working-set
    difference), and the CPU float mask moves into the working set where the compiled backward rebuilds it."""
    from pretrain.memory import activation_bytes_per_token_layer, backward_working_set

    cfg = load_config(write_recipe(tmp_path / "r.yaml", model={"n_layers": 3, **GELU_LN}),
                      ["model.vocab_size=300", "model.mask_id=299", f"train.activation_checkpointing={mode}"])
    m = cfg.model
    T, b = 2 * cfg.data.seq_len, cfg.train.micro_batch  # two-stream SetDLM
    eager = estimate_memory(cfg, 1, device="cpu", precision="fp32")[0]
    cfg.train.compile = True
    compiled = estimate_memory(cfg, 1, device="cpu", precision="fp32")[0]
    assert estimate_memory(cfg, 1, device="cpu", precision="fp32", compiled=False)[0].activations == eager.activations
    saved = [activation_bytes_per_token_layer(m, 1, T, 4, "cpu", mode, compiled=c) for c in (False, True)]
    work = [backward_working_set(m, 1, T, 4, "cpu", mode, compiled=c) for c in (False, True)]
    mask = T * T * 4 if mode == "selective" else 0  # rebuilt by the compiled backward of the recomputed core
    want = 3 * T * b * (saved[1] - saved[0]) + T * b * (work[1] - work[0]) + mask
    assert compiled.activations - eager.activations == pytest.approx(want)
    assert (compiled.weights, compiled.logits) == (eager.weights, eager.logits)
    if mode == "selective":
        assert saved[1] < saved[0] and work[1] > work[0]  # fc2's input is rebuilt in the backward, not saved


@pytest.mark.parametrize("block", [GELU_LN, SWIGLU_RMS, QWEN3_GQA, dict(QWEN3_GQA, n_kv_heads=None)])
def test_eager_saved_bytes_are_what_autograd_saves(tmp_path, block):
    """The eager per-layer count against the tensors autograd really saves in a tiny model on CPU: the
    saved storages (parameters excluded) of a 2-layer model minus those of a 1-layer model."""
    from model.transformer import Transformer
    from pretrain.memory import activation_bytes_per_token_layer

    B, T = 2, 16

    def saved_bytes(n_layers):
        m = _model(tmp_path, n_layers=n_layers, **block)
        torch.manual_seed(0)
        model = Transformer(m)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                seen[s.data_ptr()] = s.nbytes()
            return t

        ids = torch.randint(0, 299, (B, T))
        pos = torch.arange(T).expand(B, T)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, pos, mask)
        return sum(seen.values()), m

    one, _ = saved_bytes(1)
    two, m = saved_bytes(2)
    want = activation_bytes_per_token_layer(m, 1, T, 4, "cpu", "none") * B * T + T * T * 4  # + the float mask
    assert two - one == want


# -- context parallelism, the step time, the hardware and the ranked layouts ---------------------------------
QWEN3_8B = "configs/qwen3-8b-setdlm.yaml"
QWEN3_VOCAB = ["model.vocab_size=151670", "model.mask_id=151669"]


@pytest.mark.parametrize("tp,pp,dp,cp", [(2, 2, 2, 2), (1, 3, 2, 4), (8, 1, 2, 2), (2, 1, 3, 1), (1, 1, 1, 3)])
def test_groups_with_context_parallelism_are_megatron_s(tp, pp, dp, cp):
    from pretrain.plan import groups_of

    g = rank_groups(tp, pp, dp, cp)
    world = tp * pp * dp * cp
    for name, size in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp), ("replica", dp * cp)):
        assert sorted(r for group in g[name] for r in group) == list(range(world)), name
        assert all(len(x) == size for x in g[name]), name
    for r in range(world):
        mine = groups_of(r, tp, pp, dp, cp)
        for name in ("tp", "cp", "pp", "dp", "replica"):
            assert list(mine[name]) == next(x for x in g[name] if r in x), (tp, pp, dp, cp, r, name)


def test_dry_run_of_the_8b_recipe_with_context_parallelism(tmp_path, capsys):
    """The issue's acceptance line (with the qwen3 tokenizer's vocabulary given, as a machine without it
    would): CP groups, the K/V exchange and the step-time split are printed."""
    code = cli_main(["pretrain", "--config", QWEN3_8B, "--dry-run", "--world-size", "64", "--out", str(tmp_path),
                     "parallel.cp=2", *QWEN3_VOCAB])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "world 64 = TP 2 x CP 2 x PP 1 x DP 16 | ZeRO-2 over DP x CP = 32 ranks" in out
    assert "32 CP groups of 2" in out and "context parallel" in out and "CP group" in out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["5"])  # rank 5: TP 4,5; CP 5,7
    assert row.split()[3:5] == ["4,5", "5,7"], row
    for part in ("compute", "memory-bound", "TP/SP comm", "CP comm", "PP bubble + sends", "DP/ZeRO comm", "MFU"):
        assert part in out, part
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("overrides,field", [
    (["parallel.cp=3"], "parallel.cp"),  # 4096 is not divisible by 2 * 3
    (["parallel.cp=2", "objective.name=bd3lm", "objective.block_size=16", "data.seq_len=96", "model.max_seq_len=96"],
     "parallel.cp"),  # chunks of 24 tokens are not whole blocks of 16
    (["parallel.overlap_comm=true", "parallel.zero_stage=3", "parallel.tp=1", "parallel.sequence_parallel=false"],
     "parallel.overlap_comm"),
    (["parallel.overlap_comm=true", "parallel.pp=2", "parallel.zero_stage=1"], "parallel.overlap_comm"),
])
def test_context_parallel_and_overlap_layouts_refused_naming_the_field(tmp_path, capsys, overrides, field):
    code = cli_main(["pretrain", "--config", QWEN3_8B, "--dry-run", "--world-size", "48", *QWEN3_VOCAB, *overrides])
    err = capsys.readouterr().err
    assert code == 2 and field in err and len(err.strip().splitlines()) == 1, err


def test_context_parallelism_splits_activations_and_shards_zero_over_dp_x_cp():
    cfg = load_config(QWEN3_8B, QWEN3_VOCAB + ["parallel.zero_stage=1", "parallel.overlap_comm=false"])
    one = estimate_memory(cfg, 64)[0]
    cfg.parallel.cp = 4
    four = estimate_memory(cfg, 64)[0]
    assert four.optimizer == pytest.approx(one.optimizer)  # ZeRO over dp x cp = 32 ranks either way
    assert 0.25 * one.activations < four.activations < 0.3 * one.activations  # + the gathered K/V
    assert four.logits == pytest.approx(one.logits / 4)


def test_step_time_split_adds_up_and_mfu_is_an_output():
    from pretrain.comm import step_collectives
    from pretrain.flops import step_flops
    from pretrain.hardware import PRESETS
    from pretrain.steptime import step_time

    cfg = load_config(QWEN3_8B, QWEN3_VOCAB + ["parallel.tp=8", "parallel.zero_stage=1", "train.micro_batch=4",
                                              "parallel.overlap_comm=false"])
    h100 = PRESETS["h100"]
    st = step_time(cfg, 64, h100)
    assert st.total == pytest.approx(sum(s for _, s in st.split()))
    assert st.mfu == pytest.approx(step_flops(cfg).model / (st.total * 64 * h100.peak_tflops * 1e12))
    assert st.compute == pytest.approx(st.matmul + st.attention) and st.matmul > 0 and st.attention > 0
    # the arithmetic: TP 8 + SP moves about 676 GB per GPU per step (the backward re-gather counted)
    assert 676e9 <= st.sent["tp"] <= 690e9, st.sent["tp"] / 1e9
    cfg.parallel.sequence_parallel = False
    plain = sum(c.sent for c in step_collectives(cfg, 64, "bf16") if c.axis == "tp")
    assert 1.23 < st.sent["tp"] / plain < 1.26  # 10 half-collectives per block, not 8
    # a GPU twice as fast at matrix products halves the compute, not the communication
    fast = step_time(cfg, 64, dataclasses.replace(h100, peak_tflops=2 * h100.peak_tflops))
    slow = step_time(cfg, 64, h100)
    assert fast.compute == pytest.approx(slow.compute / 2) and fast.tp == pytest.approx(slow.tp)


def test_hardware_presets_and_overrides(tmp_path, capsys, monkeypatch):
    recipe = write_recipe(tmp_path / "r.yaml")
    base = ["pretrain", "--config", str(recipe), "--dry-run", "--world-size", "2", "train.micro_batch=2"]
    assert cli_main(base + ["--hardware", "h200"]) == 0
    out = capsys.readouterr().out
    assert "2 x H200 SXM" in out and "HBM 4.8 TB/s" in out and "within 90% of 139 GiB" in out
    monkeypatch.setenv("SETDLM_NVLINK_GBPS", "900")
    assert cli_main(base) == 0
    assert "NVLink 900 GB/s" in capsys.readouterr().out
    for var, value in (("SETDLM_MATMUL_EFFICIENCY", "1.5"), ("SETDLM_HBM_TBPS", "fast"), ("SETDLM_PEAK_TFLOPS", "-1")):
        monkeypatch.setenv(var, value)
        assert cli_main(base) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and var in err[0], err
        monkeypatch.delenv(var)
    assert cli_main(["pretrain", "--config", str(recipe), "--hardware", "h100"]) == 2
    assert "only with --dry-run" in capsys.readouterr().err
    assert cli_main(base + ["--hardware", "a100"]) == 2


def test_compare_layouts_ranks_what_the_step_time_model_says(tmp_path, capsys):
    from pretrain.hardware import PRESETS
    from pretrain.layouts import candidates
    from pretrain.steptime import step_time

    recipe = write_recipe(tmp_path / "r.yaml", model={"n_layers": 4, "hidden": 64, "n_heads": 4, "ffn_hidden": 128},
                          train={"micro_batch": 1, "global_batch": 4})
    vocab = ["model.vocab_size=300", "model.mask_id=299"]
    code = cli_main(["pretrain", "--config", str(recipe), "--dry-run", "--world-size", "2", "--compare-layouts", *vocab])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "fastest first" in out and "| 1 | " in out and "the fastest as overrides:" in out
    cfg = load_config(recipe, vocab + ["train.global_batch=16"])
    cands = candidates(cfg, 8, PRESETS["h100"], tps=(1, 2), cps=(1, 2), pps=(1, 2), micro_batches=(1, 2))
    times = [c.time.total for c in cands]
    assert times == sorted(times) and len(cands) > 10
    assert {(c.tp, c.cp, c.pp) for c in cands} >= {(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)}
    best = cands[0]
    again = load_config(recipe, vocab + ["train.global_batch=16", *best.overrides()])
    assert step_time(again, 8, PRESETS["h100"]).total == pytest.approx(best.time.total)
    assert not any(c.zero > 1 and c.pp > 1 for c in cands) and not any(c.zero == 3 and c.tp > 1 for c in cands)
