"""The paper-in-miniature's plan: its models, their recipe, the decoding settings they are measured
at, the sizes of the recorded and smoke runs, and the gate floors. benchmarks/paper_miniature.py runs
it, benchmarks/miniature_report.py writes its result; its docstring says why each choice was made."""

from __future__ import annotations

from model import families  # the family registry: every family name below comes from it

AR, SW, BD3, MD = (f.name for f in (families.AR, families.SETDLM, families.BD3LM, families.MDLM))
ABLATED = "ablation"  # the cache ablation's set-causal model, kept apart from SW-SetDLM's frontier
NAIVE = "naive"  # the any-order model trained with the naive masked-only estimator (the variance claim only)

# the second pilot (revision 2): BD3-LM B=4 at this learning rate, to the recorded run's step count, on PILOT_SEEDS;
# it passed, so the recorded run trains BD3-LM B=4 at it (MODELS)
PILOT_LR = {"models": ("bd3lm-b4",), "lr": 1.0e-3}

# slug (the run directories' names) -> label, family (as the report groups it), objective section of the recipe
MODELS = {
    "ar": {"label": "AR", "family": AR, "objective": {"name": AR}},
    "setdlm-d4": {"label": "SW-SetDLM D=4", "family": SW, "objective": {"name": SW, "set_size": 4}},
    # learning rate re-chosen by the second pilot (paper_miniature.py's docstring, revision 2)
    "bd3lm-b4": {"label": "BD3-LM B=4", "family": BD3, "objective": {"name": BD3, "block_size": 4},
                 "lr": PILOT_LR["lr"]},
    "mdlm": {"label": "MDLM", "family": MD, "objective": {"name": MD}},
    # the cache ablation's set-causal model: uniformly random orders, its window the whole span
    "aosetdlm": {"label": "any-order SetDLM", "family": ABLATED,
                 "objective": {"name": SW, "order": "any_order", "set_size": 32}},
    # the same model and schedule trained with the naive masked-only estimator (miniature_measure.naive_inputs)
    "aosetdlm-naive": {"label": "any-order SetDLM, naive estimator", "family": NAIVE, "estimator": "naive",
                       "objective": {"name": SW, "order": "any_order", "set_size": 32}},
}
GATES = {"ar": 0.90, "setdlm-d4": 0.50, "bd3lm-b4": 0.30, "mdlm": 0.05, "aosetdlm": 0.05}  # exact match, every seed
SEQ_LEN, NEW_TOKENS, DATA_SEED, BASE_SEED = 64, 32, 2026, 1234
PILOT_SEEDS = (101, 102)  # the schedule's pilots: seeds no claim uses
MAX_SEQ_LEN = 2 * SEQ_LEN  # rotary positions only (no weights): room for the KV cache of a whole-span window step
EVAL_BATCH = 32  # rows decoded together (continuous batching) in the accuracy and infilling evaluations
ABLATION = (("aosetdlm", "threshold 0.9"), ("mdlm", f"{NEW_TOKENS} steps, threshold 0.9"))
FRONTIER = ("setdlm-d4", "bd3lm-b4")
INFILL = {"setdlm-d4": {"threshold": 0.9, "window": 8},  # window S_max = 2D, as the paper infills
          "bd3lm-b4": {"threshold": 0.9}, "mdlm": {"threshold": 0.9}, "ar": {}}
INFILL_CLAIM = ("setdlm-d4", "bd3lm-b4")
LIKELIHOOD = ("ar", "setdlm-d4", "bd3lm-b4", "mdlm")  # the claimed order of the bound, smallest first
VARIANCE = {"token_efficient": "aosetdlm", "naive": "aosetdlm-naive"}
PROBE = ("ar", "setdlm-d4", "bd3lm-b4", "mdlm")  # teacher-forced result digits (miniature_measure.digit_probe)
PROBE_ROWS = 120  # the first test problems it reads
TEST_SETS = {"test": "the claims' test set", "test_heldout": "held-out solution steps (composition)",
             "test_reworded": "reworded questions (robustness)"}
SIZES = {
    "full": dict(seeds={m: 3 for m in MODELS},
                 steps=4000, variance_steps=(250, 500, 1000), warmup=100, layers=3, hidden=128, batch=32, lr=2.0e-3,
                 train_rows=40_000, val_rows=500, test_rows=300, heldout_rows=150, reworded_rows=150, full_text=0.25,
                 models=tuple(MODELS), thresholds=(1.0, 0.9, 0.5), mdlm_steps=(32, 8), orders=2,
                 grad_draws=32, timed_prompts=16, timed_warmup=2, timed_repeats=3),
    "smoke": dict(seeds={m: 2 for m in MODELS}, steps=30, variance_steps=(10, 20), warmup=3, layers=1, hidden=32,
                  batch=16, lr=2.0e-3, train_rows=1500, val_rows=64, test_rows=16, heldout_rows=8, reworded_rows=8,
                  full_text=0.25, models=tuple(MODELS), thresholds=(1.0, 0.5), mdlm_steps=(32, 8), orders=2,
                  grad_draws=4, timed_prompts=2, timed_warmup=1, timed_repeats=2),
}


def settings(slug: str, size: dict) -> list[tuple[str, dict]]:
    """(label, sampling overrides) of each decoding setting a model is evaluated and timed at."""
    fam = MODELS[slug]["family"]
    if fam == NAIVE:
        return []
    if fam == AR:
        return [("greedy", {})]
    if fam == MD:
        rows = [(f"{n} steps", {"steps": n, "threshold": 1.0}) for n in size["mdlm_steps"]]
        return rows + [(f"{NEW_TOKENS} steps, threshold 0.9", {"steps": NEW_TOKENS, "threshold": 0.9})]
    if fam == ABLATED:
        return [("threshold 0.9", {"threshold": 0.9})]
    return [("threshold off" if t >= 1 else f"threshold {t:g}", {"threshold": t}) for t in size["thresholds"]]


def stops(slug: str, size: dict) -> tuple[int, ...]:
    """The steps a model's training stops at to be measured before it goes on (each a separate trainer run
    resuming the last: the learning rate is constant, so this is one run): the variance claim's matched
    steps for its two runs (the naive run ends at the last of them), and the end."""
    if slug == VARIANCE["naive"]:
        return tuple(size["variance_steps"])
    if slug == VARIANCE["token_efficient"]:
        return tuple(sorted({*size["variance_steps"], size["steps"]}))
    return (size["steps"],)


def recipe(slug: str, seed: int, size: dict, out, max_steps: int, runs=None) -> dict:
    """The training recipe of one model and seed on the data under `out`, trained to `max_steps` (a constant
    learning rate, `lr`, after a linear warm-up; a checkpoint every 250 steps and at the end, the last one kept)
    in `runs` (default out/runs)."""
    h = size["hidden"]
    return {
        "run": {"name": run_name(slug, seed), "out_dir": str(runs or out / "runs"), "seed": seed},
        "model": {"n_layers": size["layers"], "hidden": h, "n_heads": 4, "ffn_hidden": 4 * h, "norm": "layernorm",
                  "activation": "gelu", "dropout": 0.0, "tie_embeddings": True, "max_seq_len": MAX_SEQ_LEN},
        "objective": dict(MODELS[slug]["objective"]),
        "data": {"source": str(out / "shards"), "tokenizer": str(out / "shards" / "tokenizer"), "seq_len": SEQ_LEN,
                 "packing": "padded"},
        "train": {"max_steps": max_steps, "micro_batch": size["batch"], "global_batch": size["batch"],
                  "lr": lr(slug, size), "lr_schedule": "constant", "warmup_steps": size["warmup"], "grad_clip": 1.0,
                  "log_every": max(1, size["steps"] // 20), "eval_every": max_steps, "eval_batches": 0,
                  "save_every": min(250, max_steps), "keep_last": 1, "sample_at_end": False},
        "logging": {"wandb": "disabled", "progress": False},
    }


def lr(slug: str, size: dict) -> float:
    """A model's learning rate: its own where MODELS gives one (re-chosen by a pilot), else SIZES'."""
    return MODELS[slug].get("lr", size["lr"])


def run_name(slug: str, seed: int) -> str:
    return f"{slug}-seed{seed}"


def seeds(size: dict, slug: str | None = None) -> list[int]:
    """A model's seeds (BASE_SEED, BASE_SEED + 1, ...); without `slug`, the most any model has."""
    n = size["seeds"][slug] if slug else max(size["seeds"].values())
    return [BASE_SEED + i for i in range(n)]
