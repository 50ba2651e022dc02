"""Context parallelism trains exactly like one process (CPU, gloo, fp32): one 4-process launch
(tests/distributed_run.py), compared with one-process references in this process.

`cp_cases` runs each case through the code the trainer runs (`build_stage`, `build_engine`,
`StepRunner`, the objective's per-rank `prepare`) for 2 optimizer steps of 4 sequences in micro-batches
of 2, each micro-batch's noise keyed by its samples' global positions (model/noise.py), then one
validation pass (the NLL bound draws). A case is FAMILY-LAYOUT with LAYOUT `tp{T}cp{C}pp{P}z{Z}[sp]`;
the data-parallel size is world / (T * C * P); `ac`: full activation checkpointing. Compared with the
family's one-process run:

- the summed per-token CE gradient of the first micro-batch at the initial weights (CP ranks' partial
  gradients summed; TP = PP = 1 cases);
- losses, gradient norms and validation NLL (1e-5 relative), and the final weights (merged shards);
- every CP rank of a replica holds the same weights after training.

Also: a byte counter around torch.distributed's collectives checks what one attention layer moves
(two-stream families: L tokens of K/V per rank, not 2L); and through the Trainer (`launch_trainer`),
the shared tiny run (conftest.py `tiny_run`) retrained at parallel.cp=2 (x DP=2) gives its losses, gradient
norms, weights and EMA; its first validation and unigram baseline are the one-process ones; cut back to
its step-2 checkpoint it resumes under the same layout as it ran; `load_model`, greedy decoding and the Hugging Face
export of it are those of the one-process run.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from distributed_run import run_distributed
from model import families
from helpers import gathered_weights, read_metrics, run_as_of, write_recipe

pytestmark = pytest.mark.slow

FAMILIES = families.names()
SEQ, GLOBAL, MICRO, STEPS, VOCAB, SEED = 16, 4, 2, 2, 250, 11
MODEL = dict(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, norm="rmsnorm", activation="swiglu",
             qk_norm=True, bias=False, tie_embeddings=True)
REL = 1e-5
PARAM_ATOL = 3e-5  # one Adam step moves a weight by up to lr = 3e-3; summation orders differ by layout
GRAD_ATOL = 1e-5

# One launch of 4 processes runs every case (a process start costs more than a tiny case): CP=4, and CP=2
# with DP=2 (every rank of a replica set of 4), for every family, then the variants.
CASES = [f"{f}-tp1cp4pp1z0" for f in FAMILIES] + [f"{f}-tp1cp2pp1z0" for f in FAMILIES] + [
    "setdlm-tp1cp2pp1z1",  # ZeRO-1 over dp x cp = 4 replicas
    "bd3lm-tp1cp2pp1z0ac",  # full activation checkpointing: the exchange rerun in the backward
    "setdlm-tp2cp2pp1z0sp",  # TP x CP with sequence parallelism inside each CP rank
    "bd3lm-tp2cp2pp1z1",
    "ar-tp1cp2pp1z3",  # ZeRO-3 partitions over dp x cp
    "setdlm-tp1cp2pp2z0",  # PP x CP
]
COUNTED = ("setdlm-tp1cp2pp1z0", "bd3lm-tp1cp2pp1z0", "mdlm-tp1cp2pp1z0", "bd3lm-tp1cp2pp1z0ac")


def parse(case: str) -> tuple[str, int, int, int, int, bool, bool]:
    m = re.fullmatch(r"(\w+)-tp(\d)cp(\d)pp(\d)z(\d)(sp)?(ac)?", case)
    if not m:
        raise ValueError(f"bad case {case!r}")
    f, tp, cp, pp, z, sp, ac = m.groups()
    return f, int(tp), int(cp), int(pp), int(z), bool(sp), bool(ac)


def recipe(family: str, tp: int, cp: int, pp: int, zero: int, sp: bool, ac: bool = False) -> dict:
    return {
        "run": {"seed": SEED},
        "model": {**MODEL, "dropout": 0.0, "max_seq_len": SEQ, "vocab_size": VOCAB, "mask_id": VOCAB - 1},
        "objective": {"name": family, "set_size": 2, "block_size": 2},
        "data": {"seq_len": SEQ},
        "train": {"micro_batch": MICRO, "global_batch": GLOBAL, "lr": 3e-3, "warmup_steps": 0, "grad_clip": 0.5,
                  "weight_decay": 0.1, "precision": "fp32", "activation_checkpointing": "full" if ac else "none"},
        "parallel": {"tp": tp, "cp": cp, "pp": pp, "zero_stage": zero, "sequence_parallel": sp},
        "logging": {"wandb": "disabled"},
    }


def micro_batches(objective, step: int, stream: int, dp_rank: int, dp: int, bound: bool = False) -> list:
    """This data-parallel rank's micro-batches of global batch `step`, prepared as the trainer prepares
    them (noise keyed by global sample positions): the same draws under any layout."""
    from model.noise import SampleNoise

    g = torch.Generator().manual_seed(1000 * stream + step)
    x = torch.randint(0, VOCAB - 1, (GLOBAL, SEQ), generator=g)
    per = GLOBAL // dp
    out = []
    for a in range(dp_rank * per, (dp_rank + 1) * per, MICRO):
        index = torch.arange(a, a + MICRO) + step * GLOBAL
        batch = {"input_ids": x[a:a + MICRO], "sample_index": index}
        out.append(objective.prepare(batch, SampleNoise(SEED, index, GLOBAL, stream), bound=bound))
    return out


class ByteCounter:
    """Counts the bytes of torch.distributed's all-gathers and reduce-scatters on one process group:
    (op, bytes of the gathered output / of the scattered input) per call."""

    OPS = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
           "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}

    def __init__(self, group):
        self.group, self.calls = group, []

    @contextlib.contextmanager
    def counting(self):
        import torch.distributed as dist

        saved = {name: getattr(dist, name) for name in self.OPS if hasattr(dist, name)}

        def wrap(name, fn):
            def counted(out, inp, *args, **kwargs):
                if kwargs.get("group") is self.group:
                    big = out if self.OPS[name] == "all_gather" else inp
                    self.calls.append((self.OPS[name], big.numel() * big.element_size()))
                return fn(out, inp, *args, **kwargs)
            return counted

        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)


def run_case(case: str, out: Path | None) -> dict:
    """One case on every rank of the current world; rank 0's result. Each TP x PP shard of the final
    weights goes to OUT/CASE_mpXX.pt (`out` None: into the result, one process)."""
    import torch.distributed as dist

    from model.context_parallel import RankLayout, exchanged_bytes
    from model.objectives import build_objective, summarize
    from model.noise import TRAIN, VAL
    from pretrain.checkpoint.save import shard_info
    from pretrain.config import from_dict
    from pretrain.engine import build_engine, zero3_init
    from pretrain.mcore import parallel_state
    from pretrain.parallel import cp_group, cp_rank, data_rank, data_size, ensure_model_parallel, replica_rank
    from pretrain.parallelize import build_stage, prepare_model
    from pretrain.pipeline import StepRunner

    family, tp, cp, pp, zero, sp, ac = parse(case)
    world = dist.get_world_size()
    cfg = from_dict(recipe(family, tp, cp, pp, zero, sp, ac))
    cfg.validate(world)
    ensure_model_parallel(tp, pp, cp)
    dp, dp_rank = data_size(), data_rank()
    torch.manual_seed(cfg.run.seed)
    model = build_stage(cfg.model, tp, pp, sequence_parallel=sp, zero_init=zero3_init(cfg, world, "fp32"), cp=cp)
    prepare_model(model, cfg)
    objective = build_objective(cfg.objective, cfg.model, SEQ, cross_entropy=model.tp.cross_entropy, context=model.cp)
    result: dict = {"case": case}
    if tp == 1 and pp == 1 and zero < 3:  # the CE-sum gradient of the first micro-batch, summed over CP ranks
        first = micro_batches(objective, 0, TRAIN, dp_rank, dp)[0]
        first.loss_scale = 1.0
        objective.loss(model(first.input_ids, first.position_ids, **first.model_kwargs()), first)[0].backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if cp > 1:
            for g in grads.values():
                dist.all_reduce(g, group=cp_group())
        result["grads"] = grads
        model.zero_grad(set_to_none=True)
    engine, _, _ = build_engine(model, cfg, world, "fp32")
    stepper = StepRunner(engine, objective, cfg)
    result.update(losses=[], grad_norms=[])
    counter = ByteCounter(cp_group()) if cp > 1 else None
    for step in range(STEPS):
        micro = micro_batches(objective, step, TRAIN, dp_rank, dp)
        with counter.counting() if counter is not None and step == 0 else contextlib.nullcontext():
            m, gnorm = stepper.train_step(micro)
        red = stepper.reduce(m)
        result["losses"].append(red["loss_sum"] / red["loss_count"])
        result["grad_norms"].append(float(gnorm))
    if counter is not None:
        layout = RankLayout(objective.mask_kind, SEQ, cp, cp_rank(), 2 if family == "bd3lm" else 0)
        per_layer = exchanged_bytes(layout, MICRO, cfg.model.kv_heads // tp, cfg.model.dim_head, 4)
        result["counted"] = {"calls": counter.calls, "per_layer": per_layer, "recompute": ac,
                             "layers": len(model.layers), "micro": GLOBAL // (MICRO * dp)}
    engine.module.eval()
    red = stepper.reduce(stepper.eval_step(micro_batches(objective, 0, VAL, dp_rank, dp, bound=True)))
    result["val_nll"] = summarize(red)["nll"]
    state = gathered_weights(engine.module, zero == 3)
    if cp > 1:  # the CP ranks of a replica hold the same weights
        flat = torch.cat([v.flatten() for v in state.values()])
        every = [torch.empty_like(flat) for _ in range(cp)]
        dist.all_gather(every, flat, group=cp_group())
        result["cp_weights_equal"] = all(torch.equal(every[0], e) for e in every)
    if out is None:
        result["weights"] = state
    elif replica_rank() == 0:
        mp = dist.get_rank(group=parallel_state.get_model_parallel_group())
        torch.save({"info": shard_info(engine), "state": state}, out / f"{case}_mp{mp:02d}.pt")
    dist.barrier()
    return result


def cp_cases(out: Path, cases: list[str]) -> dict:
    """One rank: each case, one after another; rank 0's results (and every rank's checks)."""
    from pretrain.engine import _skip_cpu_shm_op
    from pretrain.parallel import ensure_process_group

    ensure_process_group()
    _skip_cpu_shm_op()
    out = Path(out)
    return {case: run_case(case, out) for case in cases}


# -- the Trainer at cp 2: the shared tiny run (conftest.py) retrained, resumed, loaded, decoded, exported -------
def trainer_runs(recipe_path: Path, out: Path) -> None:
    from pretrain.config import load_config
    from pretrain.parallel import ensure_process_group
    from pretrain.trainer import Trainer
    import torch.distributed as dist

    ensure_process_group()
    # cp 2 x dp 2 on 4 processes; micro-batches of 2 (the one-process run: 4, training is the same)
    over = ["parallel.cp=2", "train.micro_batch=2", "train.eval_every=4", f"run.out_dir={out}"]
    Trainer(load_config(Path(recipe_path), [*over, "run.name=cp2"])).train()
    if dist.get_rank() == 0:
        run_as_of(out / "cp2", out / "cp2-resumed", 2)
    dist.barrier()
    Trainer(load_config(Path(recipe_path), [*over, "run.name=cp2-resumed"])).train()


# -- the launches, once per module ------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_run):
    from conftest import TINY_RUN_TRAIN

    out = tmp_path_factory.mktemp("cp")
    recipe_path = write_recipe(out / "tiny.yaml", train=TINY_RUN_TRAIN)
    ranks = run_distributed(_launch, 4, out, recipe_path, timeout=1200)
    return out, ranks.results[0], ranks.results, tiny_run


def _launch(out: Path, recipe_path: Path) -> dict:
    results = cp_cases(out, CASES)
    trainer_runs(recipe_path, out / "trainer")
    return results


@pytest.fixture(scope="module")
def references(model_parallel):
    """Each family's one-process run (world 1, the same code)."""
    return {f: run_case(f"{f}-tp1cp1pp1z0", None) for f in FAMILIES}


def _close(a: float, b: float, rel: float = REL) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def _weights(out: Path, case: str) -> dict:
    from pretrain.checkpoint.shards import merge

    shards = [torch.load(f, weights_only=False) for f in sorted(out.glob(f"{case}_mp*.pt"))]
    assert shards, f"no weights written for {case}"
    return merge([(s["info"], s["state"]) for s in shards])


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_trains_like_one_process(runs, references, case):
    out, results, _, _ = runs
    got, ref = results[case], references[parse(case)[0]]
    for key in ("losses", "grad_norms"):
        assert all(_close(a, b) for a, b in zip(got[key], ref[key])), (case, key, got[key], ref[key])
    assert _close(got["val_nll"], ref["val_nll"]), (case, got["val_nll"], ref["val_nll"])
    if "grads" in got:
        worst = max(((got["grads"][n] - g).abs().max().item(), n) for n, g in ref["grads"].items())
        assert worst[0] <= GRAD_ATOL, (case, "gradients differ", worst)
    assert got.get("cp_weights_equal", True), case
    weights, ref_w = _weights(out, case), ref["weights"]
    assert set(weights) == set(ref_w), set(weights) ^ set(ref_w)
    worst = max(((weights[n] - t).abs().max().item(), n) for n, t in ref_w.items())
    assert worst[0] <= PARAM_ATOL, (case, "weights differ", worst)


@pytest.mark.parametrize("case", COUNTED)
def test_an_attention_layer_moves_one_stream_of_kv(runs, case):
    """Per attention layer and micro-batch, one all-gather of K and V (forward) and one reduce-scatter of
    their gradients (backward) on the CP group, each of L tokens x (K, V) x KV heads x head dim x 4 bytes:
    the exchanged stream alone for the two-stream families (the sequence through the model is 2L). Full
    activation checkpointing reruns the forward's all-gather in the backward."""
    _, results, _, _ = runs
    c = results[case]["counted"]
    L_tokens = 2 * MICRO * MODEL["n_kv_heads"] * SEQ * (MODEL["hidden"] // MODEL["n_heads"]) * 4
    assert c["per_layer"] == L_tokens
    n = c["layers"] * c["micro"]
    gathers = 2 * n if c["recompute"] else n
    assert sorted(c["calls"]) == sorted([("all_gather", L_tokens)] * gathers + [("reduce_scatter", L_tokens)] * n), c


def test_trainer_at_cp2_is_the_one_process_run(runs, model_parallel):
    """The shared tiny run retrained with parallel.cp=2 (through the Trainer, CP=2 x DP=2)."""
    from pretrain.checkpoint.inference import load_model
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    out, _, _, tiny = runs
    _, tiny_dir = tiny
    cp_dir = out / "trainer" / "cp2"
    ref, got = read_metrics(tiny_dir), read_metrics(cp_dir)
    for step in (2, 4):
        for key in ("train/loss", "train/grad_norm"):
            assert _close(got[step][key], ref[step][key]), (step, key, got[step][key], ref[step][key])
    # the first validation and the unigram baseline: those of one process at the same (initial) weights
    cfg = load_config(out / "tiny.yaml", ["train.eval_every=4", f"run.out_dir={out / 'one'}"])
    one = Trainer(cfg)
    val = one.validate()
    assert _close(got[0]["val/nll"], val["val/nll"]), (got[0]["val/nll"], val["val/nll"])
    assert got[0]["val/rows"] == val["val/rows"] and got[0]["val/tokens"] == val["val/tokens"], (got[0], val)
    assert _close(got[0]["val/unigram_nll"], one.validation.unigram_nll(), 1e-12)
    assert got[4]["train/tokens_seen"] == ref[4]["train/tokens_seen"]
    # resumed at cp 2 from its step-2 checkpoint: the uninterrupted run's steps 3-4
    resumed = read_metrics(out / "trainer" / "cp2-resumed")
    for key in ("train/loss", "train/grad_norm"):
        assert _close(resumed[4][key], got[4][key], 1e-6), (key, resumed[4][key], got[4][key])
    # load_model, greedy decoding and the export of the CP run are the one-process run's
    import model.sampling as sampling

    for ema in (False, True):  # the trained weights, and the EMA load_model decodes with by default
        a, b = (load_model(d, ema=ema)[0].state_dict() for d in (cp_dir, tiny_dir))
        a, b = ({k: v for k, v in d.items() if torch.is_tensor(v)} for d in (a, b))
        assert set(a) == set(b) and max((a[k].float() - b[k].float()).abs().max().item() for k in a) <= PARAM_ATOL
    m_cp, tok, cfg_cp = load_model(cp_dir)
    m_one, _, _ = load_model(tiny_dir)
    prompt = [tok.encode("The for statement")]
    sc = sampling.SamplingConfig.from_objective(cfg_cp.objective, max_new_tokens=8)
    assert sampling.generate(m_cp, prompt, sc)[0].tokens == sampling.generate(m_one, prompt, sc)[0].tokens
    from pretrain.convert.export import export_checkpoint

    hf = export_checkpoint(cp_dir, out / "hf", log=lambda s: None)
    assert (hf / "config.json").is_file()


def test_checkpoint_of_a_cp_run_records_the_layout(runs):
    out, _, _, _ = runs
    meta = json.loads((out / "trainer" / "cp2" / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert meta["layout"]["cp"] == 2 and meta["layout"]["dp"] == 2 and meta["layout"]["world"] == 4
    shutil.rmtree(out / "hf", ignore_errors=True)
