"""The paper-in-miniature's measurements of one trained model (benchmarks/paper_miniature.py runs them):
accuracy on the reasoning task (`setdlm eval gsm8k --backend direct`, the eval API), infilling, the
likelihood bound (`eval likelihood`), the gradient variance of one training estimator at a
checkpoint, and the timed pass (tokens/s at batch 1 after warm-up, median over repeats).

Gradient variance, as the reference implementation's LogGradientVariance defines it: K gradients
g_1..g_K of the training loss, over the non-embedding parameters (the tied output head is the
embedding, so it is left out too), give V = sum_k ||g_k - mean(g)||^2 / (K - 1). Here the K
gradients are taken at the same weights (a checkpoint), draw k on batch k of the run's own training
order (data and noise vary, as between training steps). Two estimators of the any-order SetDLM's
training gradient:

- token-efficient (the stack's `setdlm` objective): one generation order per row, every
  predictable token predicted from the tokens before it in that order (two-stream layout), loss the
  mean CE over every predicted token;
- naive masked-only: the schedule's masking times T_i (uniform on the any-order schedule; the
  sliding-window schedule's times otherwise), one time t ~ U(0, 1) per row; the tokens with T_i < t
  are masked and predicted in one shot from the revealed ones (T_i >= t), loss the mean CE over the
  masked tokens only (MDLM's training loss). It runs on the same model and layout: a query sees the
  revealed clean tokens and itself (a per-row mask), the other queries weigh 0.

`use_naive_estimator` makes a trainer train with the naive estimator (its validation keeps the
objective's own bound), so each estimator is measured on its own training run.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

DEFAULT_STOP = ["Question:"]  # the gsm8k task's stop string (eval/tasks/gsm8k.py)


def accuracy(run_dir: str, out: str, test: str, overrides: dict, new_tokens: int, batch: int) -> dict:
    """Exact match on the test problems, with the stack's GSM8K evaluation (direct backend)."""
    from eval import api

    m = api.gsm8k(checkpoint=run_dir, out=out, data=test, backend="direct", max_new_tokens=new_tokens,
                  batch_size=batch, overwrite=True, **overrides)
    return {"accuracy": m["accuracy"], "n": m["n"], "format_rate": m["format_rate"],
            "tokens_per_forward": m.get("speed/tokens_per_step"), "eval_tokens_per_s": m.get("speed/tokens_per_s")}


def sampling(cfg, overrides: dict, new_tokens: int, **fixed):
    """The SamplingConfig the GSM8K evaluation builds for a checkpoint's recipe `cfg` and `overrides`."""
    from model.sampling import SamplingConfig

    return SamplingConfig.from_objective(cfg.objective, max_new_tokens=new_tokens, **{**overrides, **fixed})


def infill(run_dir: str, examples: list[dict], overrides: dict, batch: int) -> dict:
    """Exact match of the masked span (and per-token accuracy), decoded with `generate` and `Infill`."""
    from eval.models import Checkpoint
    from model.sampling import Infill, generate

    ck = Checkpoint(run_dir)
    cfg = sampling(ck.cfg, overrides, 0)
    prompts = [Infill(e["prefix"], len(e["span"]), e["suffix"]) for e in examples]
    outs = generate(ck.model, prompts, cfg, tokenizer=ck.tokenizer, max_batch=batch)
    exact = [o.tokens == e["span"] for o, e in zip(outs, examples)]
    tok_acc = [sum(a == b for a, b in zip(o.tokens, e["span"])) / len(e["span"]) for o, e in zip(outs, examples)]
    steps = sum(o.steps for o in outs)
    return {"exact_match": sum(exact) / len(exact), "token_accuracy": sum(tok_acc) / len(tok_acc), "n": len(exact),
            "tokens_per_forward": sum(len(o.tokens) for o in outs) / steps if steps else None,
            "example": {"span": examples[0]["span_text"], "filled": ck.tokenizer.decode(outs[0].tokens)}}


def likelihood(run_dir: str, out: str, orders: int, batch: int) -> dict:
    """The bound on the validation split (`eval likelihood`), with its Monte-Carlo s.e. over orders."""
    from eval import api

    m = api.likelihood(checkpoint=run_dir, out=out, orders=orders, batch_size=batch, overwrite=True)
    se = m.get("nll_std_over_orders", 0.0) / math.sqrt(m["orders"]) if m["orders"] > 1 else 0.0
    return {"nll": m["nll"], "mc_se": se, "orders": m["orders"], "rows": m["sequences"], "tokens": m["tokens"]}


# -- teacher-forced result digits --------------------------------------------------------------------
def digit_probe(run_dir: str, rows: list[dict], batch: int = 64) -> dict:
    """Accuracy of each result digit of the worked solution (tens and units of both lines) predicted with
    everything else of the problem clean, in the model's training layout: AR's next token; MDLM with
    that one token masked; BD3-LM with it masked in its noisy block (clean earlier blocks); SetDLM with
    it last in the generation order (every other token revealed before it). Greedy (argmax) against
    the true digit; returns {"tens": ..., "units": ..., "n": digits per kind}."""
    from model.masks import build_mask
    from pretrain.checkpoint.inference import load_model

    model, tok, cfg = load_model(run_dir, ema=False)
    model.eval()
    name, L, mask_id = cfg.objective.name, cfg.data.seq_len, cfg.model.mask_id
    eq = tok.token_to_id("=")
    ex = []  # (ids, position, kind)
    for r in rows:
        ctx = tok.encode(f"Question: {r['question']}\nAnswer:")
        ids = (ctx + tok.encode(" " + r["answer"]) + [tok.eos_id])[:L]
        for i in range(len(ctx), len(ids) - 2):
            if ids[i] == eq:
                ex += [(ids, i + 1, "tens"), (ids, i + 2, "units")]
    hits = {"tens": 0, "units": 0}
    with torch.no_grad():
        for s in range(0, len(ex), batch):
            chunk = ex[s:s + batch]
            n = len(chunk)
            x = torch.full((n, L), tok.pad_id, dtype=torch.long)
            valid = torch.zeros(n, L, dtype=torch.bool)
            for j, (ids, _, _) in enumerate(chunk):
                x[j, :len(ids)] = torch.tensor(ids)
                valid[j, :len(ids)] = True
            ps = torch.tensor([p for _, p, _ in chunk])
            rows_ = torch.arange(n)
            pos = torch.arange(L).expand(n, L)
            if name == "ar":
                m = build_mask("causal", L)[None, None] & valid[:, None, None, :]
                logits = model(x, pos, m | torch.eye(L, dtype=torch.bool))[rows_, ps - 1]
            elif name in ("mdlm", "bd3lm"):
                xt = x.clone()
                xt[rows_, ps] = mask_id
                if name == "mdlm":
                    m = build_mask("bidirectional", L)[None, None] & valid[:, None, None, :]
                    logits = model(xt, pos, m | torch.eye(L, dtype=torch.bool))[rows_, ps]
                else:
                    kv = torch.cat((valid, valid), 1)
                    m = build_mask("block_diffusion", L, cfg.objective.block_size)[None, None] & kv[:, None, None, :]
                    logits = model(torch.cat((xt, x), 1), torch.cat((pos, pos), 1), m | torch.eye(2 * L, dtype=torch.bool),
                                   logits_slice=slice(0, L))[rows_, ps]
            else:  # setdlm: the target last among the valid tokens; padding after it
                key = torch.where(valid, -pos.double(), -1e9 - pos.double())
                key[rows_, ps] = -1e6
                perm = torch.argsort(key, dim=1, descending=True, stable=True)
                clean = torch.gather(x, 1, perm)
                rank = (perm == ps[:, None]).int().argmax(1)
                query = clean.clone()
                query[rows_, rank] = mask_id
                m = build_mask("set_causal", L)
                logits = model(torch.cat((clean, query), 1), torch.cat((perm, perm), 1), m,
                               logits_slice=slice(L, 2 * L))[rows_, rank]
            pred = logits.argmax(-1)
            for j, (ids, p, kind) in enumerate(chunk):
                hits[kind] += int(pred[j] == ids[p])
    per = len(ex) // 2
    return {"tens": hits["tens"] / per, "units": hits["units"] / per, "n": per}


# -- gradient variance ----------------------------------------------------------------------------
def naive_inputs(obj, batch: dict, generator):
    """Model inputs of naive masked-only training (module docstring) on the SW-SetDLM layout."""
    from model.noise import rand
    from model.objectives import ModelInputs

    x, valid, context = obj._batch_masks(batch)
    B, L = x.shape
    if obj.cfg.order == "any_order":
        T = rand((B, L), generator, x.device, torch.float64)
    else:
        T = obj.schedule.masking_times(B, generator, x.device)
    pos = torch.arange(L, dtype=torch.float64, device=x.device).expand(B, L)
    key = torch.where(context, 2.0 + (L - pos) / L, T)  # as model.schedule.sample_order orders them
    key = torch.where(valid, key, -1.0 - pos / L)
    perm = torch.argsort(key, dim=1, descending=True, stable=True)
    t = rand((B, 1), generator, x.device, torch.float64)
    masked = valid & ~context & (T < t)
    # per row: ranks [0, r0) are revealed, [r0, r0 + m) masked (the lowest keys among the valid tokens)
    r0 = (valid.sum(1) - masked.sum(1))[:, None]
    clean = torch.gather(x, 1, perm)
    pred = torch.gather(masked, 1, perm)
    query = torch.where(pred, torch.full_like(clean, obj.mask_id), clean)
    ranks = torch.arange(L, device=x.device)
    mask = torch.zeros(B, 2 * L, 2 * L, dtype=torch.bool, device=x.device)
    mask[:, :L, :L] = ranks[:, None] >= ranks[None, :]  # clean stream: causal in generation order
    mask[:, L:, :L] = (ranks[None, None, :] < r0[:, :, None]).expand(B, L, L)  # query -> the revealed set
    mask[:, L:, L:] = torch.eye(L, dtype=torch.bool, device=x.device)  # query -> itself
    w = pred.float()
    return ModelInputs(input_ids=torch.cat((clean, query), 1), position_ids=torch.cat((perm, perm), 1),
                       attn_mask=mask[:, None], logits_slice=slice(L, 2 * L), targets=clean, loss_weight=w,
                       nll_weight=torch.zeros_like(w), num_tokens=w.sum(), extra={"perm": perm, "r0": r0[:, 0]})


def grad_vector(model, obj, inputs) -> torch.Tensor:
    """The gradient of the objective's training loss (mean CE over weighted tokens), non-embedding parameters."""
    model.zero_grad(set_to_none=True)
    logits = model(inputs.input_ids, inputs.position_ids, inputs.attn_mask, logits_slice=inputs.logits_slice)
    loss, _ = obj.loss(logits, inputs)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for n, p in model.named_parameters()
                      if "embed" not in n and p.grad is not None])


def total_variance(grads: list[torch.Tensor]) -> float:
    """sum_k ||g_k - mean||^2 / (K - 1) (the reference's LogGradientVariance)."""
    g = torch.stack(grads).double()
    return float((g - g.mean(0)).pow(2).sum() / (g.shape[0] - 1))


def use_naive_estimator(trainer) -> None:
    """Train `trainer` (pretrain.trainer.Trainer of a `setdlm` recipe) with the naive masked-only estimator:
    its training draws come from `naive_inputs`; its validation bound stays the objective's."""
    obj = trainer.objective
    own = obj.prepare

    def prepare(batch, generator=None, bound: bool = False):
        return own(batch, generator, bound=True) if bound else naive_inputs(obj, batch, generator)

    obj.prepare = prepare


def gradient_variance(run_dir: str, estimator: str, draws: int, batch: int) -> dict:
    """V of `estimator` ("token_efficient" or "naive") at the run's latest checkpoint, over `draws`
    batches of its training order (module docstring)."""
    from data_pipeline.loader import build_loader
    from model.objectives import build_objective
    from pretrain.checkpoint.inference import load_model

    model, tok, cfg = load_model(run_dir, ema=False)
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    obj = build_objective(cfg.objective, cfg.model, cfg.data.seq_len)
    prep = {"token_efficient": lambda b, g: obj.prepare(b, g), "naive": lambda b, g: naive_inputs(obj, b, g)}[estimator]
    data = dataclasses.replace(cfg.data, num_workers=0)
    loader = build_loader(data, split="train", tokenizer=tok, micro_batch=batch, seed=cfg.run.seed)
    grads, tokens = [], []
    for k, b in enumerate(loader):
        if k == draws:
            break
        inp = prep(b, torch.Generator().manual_seed(10_000 + k))
        tokens.append(float(inp.loss_weight.sum()))
        grads.append(grad_vector(model, obj, inp))
    mean = torch.stack(grads).double().mean(0)
    v = total_variance(grads)
    return {"estimator": estimator, "variance": v, "mean_grad_sq_norm": float(mean.pow(2).sum()),
            "relative_variance": v / float(mean.pow(2).sum()), "predicted_tokens_per_draw": statistics.fmean(tokens),
            "draws": draws, "batch": batch, "parameters": "non-embedding",
            "definition": "sum_k ||g_k - mean g||^2 / (K - 1)"}


# -- the timed pass ---------------------------------------------------------------------------------
def timed(model, tokenizer, prompts: list, cfg, *, warmup: int, repeats: int) -> dict:
    """tokens/s at batch 1: `warmup` untimed decodes (the first prompts), then `repeats` passes over
    `prompts`, one `generate` per prompt; a pass's rate is its new tokens over its summed seconds. The
    median pass is reported with every pass's rate and the load average before and after."""
    import os

    from model.sampling import generate

    for i in range(warmup):
        generate(model, [prompts[i % len(prompts)]], cfg, tokenizer=tokenizer)
    load0 = os.getloadavg()
    rates, steps, toks = [], 0, 0
    for _ in range(repeats):
        secs, n = 0.0, 0
        for p in prompts:
            t0 = time.perf_counter()
            o = generate(model, [p], cfg, tokenizer=tokenizer)[0]
            secs += time.perf_counter() - t0
            n += len(o.tokens)
            steps += o.steps
            toks += len(o.tokens)
        rates.append(n / secs if secs > 0 else 0.0)
    return {"tokens_per_s": statistics.median(rates), "passes": rates, "tokens_per_forward": toks / steps if steps else None,
            "prompts": len(prompts), "warmup": warmup, "load_before": list(load0), "load_after": list(os.getloadavg())}
