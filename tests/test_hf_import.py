"""train.init_from with stock Hugging Face causal LMs (tiny random Qwen3 and Llama built locally with
`transformers`): the imported model's AR logits equal transformers' own forward (fp32, 1e-4) under
TP=1 and TP=2 (2-process gloo), the import exported back with `setdlm convert to-hf` still matches,
and bad sources fail before any work with a message naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distributed_run import run_distributed
from helpers import REPO, setdlm
from hf_fixtures import hf_logits, make_hf_model

N_REAL = 50257  # GPT-2 tokens; our vocabulary adds MASK (logit -inf), HF pads its embedding to 50304
SEQ = 12


def ids_for_test() -> torch.Tensor:
    return torch.randint(0, 50257, (2, SEQ), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"qwen3": make_hf_model(root / "qwen3", "qwen3"), "llama": make_hf_model(root / "llama", "llama")}


def import_rank(hf_dir: Path, target: Path, tp: int = 1, pp: int = 1) -> None:
    """One rank: import a Hugging Face directory under a TP x PP layout through the trainer's code
    (`init_from.prepare`, `build_stage`, `build_engine`, `init_from.load`), run the AR forward, save.
    Writes, on rank 0, RUN/logits.pt (the gathered full-vocabulary AR logits of fixed token ids, last
    stage) and, from every rank, a step-0 checkpoint RUN/checkpoints/step_00000000 of this layout (with
    config and tokenizer), which `setdlm convert to-hf` consolidates and exports."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from data_pipeline.tokenizers import load_tokenizer
    from model.objectives import build_objective
    from pretrain.parallel import ensure_model_parallel, ensure_process_group
    from model.transformer import full_logits
    from pretrain import init_from
    from pretrain.checkpoint.rng import rng_state
    from pretrain.checkpoint.writer import save
    from pretrain.config import from_dict, save_config
    from pretrain.engine import _skip_cpu_shm_op, build_engine
    from pretrain.parallelize import build_stage

    ensure_process_group()
    _skip_cpu_shm_op()
    run = Path(target)
    cfg = from_dict({"run": {"out_dir": str(run.parent), "name": run.name, "seed": 3},
                     "objective": {"name": "ar"}, "data": {"seq_len": SEQ},
                     "train": {"init_from": str(hf_dir), "micro_batch": 1, "global_batch": 1 * (dist.get_world_size()
                                                                                             // (tp * pp))},
                     "parallel": {"tp": tp, "pp": pp}, "logging": {"wandb": "disabled"}})
    source = init_from.prepare(cfg)
    tok = load_tokenizer(cfg.data.tokenizer, add_mask=cfg.data.add_mask_token)
    cfg.resolve_vocab(tok)
    cfg.validate(dist.get_world_size())
    ensure_model_parallel(tp, pp)
    torch.manual_seed(cfg.run.seed)
    model = build_stage(cfg.model, tp, pp)
    engine, _, _ = build_engine(model, cfg, dist.get_world_size(), "fp32")
    notes = init_from.load(engine, source, cfg.model)
    assert notes, "init_from.load did not load anything"
    objective = build_objective(cfg.objective, cfg.model, SEQ)
    inputs = objective.prepare({"input_ids": ids_for_test()})
    engine.module.eval()
    last = parallel_state.is_pipeline_last_stage()
    from pretrain.compat_cpu import megatron_compat

    with torch.no_grad(), megatron_compat():
        if pp == 1:
            logits = engine.module(inputs.input_ids, inputs.position_ids, attn_mask=inputs.attn_mask)
            full = full_logits(engine.module, logits)
        else:
            full = None  # parity under PP is the consolidation + export below
    if dist.get_rank() == 0:
        run.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run / "config.yaml")
        tok.save(run / "tokenizer")
        if full is not None and last:
            torch.save(full, run / "logits.pt")
    dist.barrier()
    meta = {"step": 0, "tokens_seen": 0, "wandb_id": None, "tokenizer": tok.name, "tokenizer_sha256": tok.sha256,
            "objective": "ar", "config": cfg.to_dict(),
            "layout": {"world": dist.get_world_size(), "tp": tp, "pp": pp,
                       "dp": parallel_state.get_data_parallel_world_size(), "zero_stage": 0}}
    save(engine, run / "checkpoints", 0, meta=meta, extra={"rng": rng_state()}, keep_last=1, rank=dist.get_rank())


def _worker(model, run, tp: int):
    run_distributed(import_rank, tp, model, run, tp, timeout=600)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_imported_logits_match_transformers_one_process(hf_dirs, tmp_path, arch):
    from data_pipeline.tokenizers import load_tokenizer
    from model.objectives import build_objective
    from pretrain.parallel import ensure_model_parallel
    from model.transformer import Transformer, full_logits
    from pretrain import init_from

    cfg, source = _prepare(tmp_path, hf_dirs[arch], objective="ar")
    cfg.resolve_vocab(load_tokenizer(cfg.data.tokenizer, add_mask=cfg.data.add_mask_token))
    cfg.validate(1)
    ensure_model_parallel(1, 1)
    model = Transformer(cfg.model).eval()
    _load_strict(model, init_from.weights(source, cfg.model).state_dict())
    ids = ids_for_test()
    inputs = build_objective(cfg.objective, cfg.model, ids.shape[1]).prepare({"input_ids": ids})
    with torch.no_grad():
        ours = full_logits(model, model(inputs.input_ids, inputs.position_ids, attn_mask=inputs.attn_mask))
    assert torch.isinf(ours[..., N_REAL]).all()  # the added MASK is never predicted
    torch.testing.assert_close(ours[..., :N_REAL], hf_logits(hf_dirs[arch], ids)[..., :N_REAL], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3"])  # llama: one process above, its stock export in test_stock_export.py
def test_imported_logits_match_transformers_under_tp2_and_survive_export(hf_dirs, tmp_path, arch):
    ids = ids_for_test()
    ref = hf_logits(hf_dirs[arch], ids)[..., :N_REAL]
    run = tmp_path / "run"
    _worker(hf_dirs[arch], run, 2)
    ours = torch.load(run / "logits.pt")
    assert ours.shape[-1] == N_REAL + 1 and torch.isinf(ours[..., N_REAL]).all()  # MASK never predicted
    torch.testing.assert_close(ours[..., :N_REAL], ref, atol=1e-4, rtol=0)
    # Export the (for tp=2: sharded, consolidated on the fly) checkpoint and run the export's own code.
    out = tmp_path / "export"
    r = setdlm("convert", "to-hf", "--checkpoint", run, "--out", out, "--format", "setdlm")
    assert r.returncode == 0, r.stderr[-3000:]
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    exported = AutoModelForMaskedLM.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = exported(ids, attention_type="causal").logits
    torch.testing.assert_close(logits[..., :N_REAL].float(), ref, atol=1e-4, rtol=0)
    # The default export of this AR import is the stock architecture it came from (tests/test_stock_export.py).
    r = setdlm("convert", "to-hf", "--checkpoint", run, "--out", tmp_path / "stock")
    assert r.returncode == 0, r.stderr[-3000:]
    stock = AutoModelForCausalLM.from_pretrained(str(tmp_path / "stock"), dtype=torch.float32).eval()
    assert stock.config.model_type == arch
    with torch.no_grad():
        torch.testing.assert_close(stock(input_ids=ids).logits[..., :N_REAL].float(), ref, atol=1e-4, rtol=0)
    # init_from a setdlm checkpoint of another layout (TP=2 shards, consolidated on the fly), in one process.
    from data_pipeline.tokenizers import load_tokenizer
    from pretrain.parallel import ensure_model_parallel
    from model.transformer import Transformer, full_logits
    from pretrain import init_from

    cfg, source = _prepare(tmp_path, run, objective="ar")
    assert source.kind == "checkpoint" and cfg.model.n_layers == 2 and cfg.data.tokenizer == str(run / "tokenizer")
    cfg.resolve_vocab(load_tokenizer(cfg.data.tokenizer, add_mask=cfg.data.add_mask_token))
    ensure_model_parallel(1, 1)
    model = Transformer(cfg.model).eval()
    _load_strict(model, init_from.weights(source, cfg.model))
    with torch.no_grad():
        again = full_logits(model, model(ids, torch.arange(ids.shape[1]).expand_as(ids),
                                         attn_mask=torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()))
    torch.testing.assert_close(again, ours, atol=1e-5, rtol=0)


def _prepare(tmp_path, init_from, objective="setdlm", **model):
    from pretrain import init_from as hook
    from pretrain.config import from_dict

    cfg = from_dict({"run": {"out_dir": str(tmp_path / "runs"), "name": "x"}, "model": model,
                     "objective": {"name": objective},
                     "train": {"init_from": str(init_from)}, "data": {"seq_len": 16}})
    return cfg, hook.prepare(cfg)


def test_config_comes_from_config_json_and_a_disagreeing_recipe_names_the_field(hf_dirs, tmp_path):
    cfg, src = _prepare(tmp_path, hf_dirs["qwen3"])
    m = cfg.model
    assert (m.n_layers, m.hidden, m.n_heads, m.kv_heads, m.dim_head, m.ffn_hidden) == (2, 32, 4, 2, 16, 48)
    assert (m.norm, m.activation, m.qk_norm, m.bias, m.tie_embeddings, m.rope_base, m.norm_eps) == (
        "rmsnorm", "swiglu", True, False, True, 1_000_000.0, 1e-5)
    assert cfg.data.tokenizer == str(hf_dirs["qwen3"]) and cfg.data.add_mask_token and src.n_real == N_REAL
    cfg, _ = _prepare(tmp_path, hf_dirs["llama"])
    assert (cfg.model.qk_norm, cfg.model.tie_embeddings, cfg.model.rope_base) == (False, False, 500_000.0)
    with pytest.raises(ValueError, match=r"model\.n_layers: the recipe sets 5 .* has 2"):
        _prepare(tmp_path, hf_dirs["qwen3"], n_layers=5)
    with pytest.raises(ValueError, match=r"model\.n_layers: .*preset 'qwen3-1.7b'"):
        _prepare(tmp_path, hf_dirs["qwen3"], preset="qwen3-1.7b")


def test_init_from_keeps_every_value_the_recipe_gives_and_says_each_change(hf_dirs, tmp_path):
    """An explicit `dropout: 0.1` (the default's value) is the user's choice: kept, not replaced by the
    0.0 a recipe that leaves dropout unset gets; every value init_from changes is a note."""
    from pretrain import init_from as hook
    from pretrain.config import from_dict

    def prepare(**model):
        cfg = from_dict({"run": {"out_dir": str(tmp_path)}, "model": model, "objective": {"name": "ar"},
                         "train": {"init_from": str(hf_dirs["qwen3"])}, "data": {"seq_len": 16}})
        return cfg, hook.prepare(cfg)

    cfg, src = prepare(dropout=0.1, max_seq_len=64)
    assert (cfg.model.dropout, cfg.model.max_seq_len) == (0.1, 64)
    assert not any("model.dropout" in n or "model.max_seq_len" in n for n in src.notes), src.notes
    cfg, src = prepare()
    assert cfg.model.dropout == 0.0
    notes = "\n".join(src.notes)
    for said in ("model.dropout 0.1 -> 0.0", "model.max_seq_len", "data.tokenizer 'gpt2' ->", "data.add_mask_token",
                 "n_layers 2"):
        assert said in notes, (said, notes)
    assert all("\n" not in n for n in src.notes)


def _write_config(d, **config):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("case,match", [
    ("nothing", r"train\.init_from: '.*nothing' does not exist"),
    ("not_causal", r"not a causal language model"),
    ("gpt2", r"model_type 'gpt2' is not supported"),
    ("pickle", r"only pickle weights"),
    ("rope_scaling", r"rope_type 'llama3' .* not supported"),
    ("vocab", r"tokenizer/model vocabulary mismatch"),
])
def test_bad_sources_fail_before_any_work(hf_dirs, tmp_path, case, match):
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 48, "vocab_size": 50304}
    d = tmp_path / case
    if case == "not_causal":
        _write_config(d, architectures=["BertForMaskedLM"], model_type="bert")
    elif case == "gpt2":
        _write_config(d, architectures=["GPT2LMHeadModel", "GPT2ForCausalLM"], model_type="gpt2")
    elif case == "pickle":
        _write_config(d, **base)
        (d / "pytorch_model.bin").write_bytes(b"not read")
    elif case == "rope_scaling":
        _write_config(d, **base, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0})
    elif case == "vocab":
        make_hf_model(d, "qwen3", rows=1000)
    with pytest.raises(ValueError, match=match):
        _prepare(tmp_path, d)


@pytest.mark.slow
def test_cli_reports_a_bad_init_from_in_one_line(tmp_path):
    r = setdlm("pretrain", "--config", REPO / "configs" / "quickstart.yaml", "--out", tmp_path,
               f"train.init_from={tmp_path / 'missing'}", timeout=120)
    assert r.returncode != 0
    assert "train.init_from" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def _load_strict(model, state):
    """Every parameter and buffer present (megatron-style linears' empty `_extra_state` may be absent)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
