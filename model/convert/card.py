"""The model card (README.md) of a Hugging Face export: usage, architecture, schedule, recipe, results."""

from __future__ import annotations

from data_pipeline.config import MixtureEntry

from .. import families


# The card's words on the export's set_diffusion_generate, by decoding mode (FamilySpec.decoding; a
# family's own card_usage replaces them).
DECODING_USAGE = {
    "next_token": "`set_diffusion_generate` decodes left to right, one token per step (greedy or sampled).",
    "set_window": ("`set_diffusion_generate` predicts the masked positions of a window of `window` positions (default "
                   "D) per step, accepts the most confident one plus every one whose probability reaches `threshold`, "
                   "and caches accepted tokens; `suffix_ids=` fills a span between a prefix and a suffix."),
    "block": ("`set_diffusion_generate` denoises blocks of `block_size` positions left to right, `steps` steps per "
              "block (default: the block size), each unmasking the most confident positions (plus every one whose "
              "probability reaches `threshold`); a completed block enters the KV cache. `suffix_ids=` fills a span "
              "between a prefix and a suffix."),
    "full_sequence": ("`set_diffusion_generate` unmasks the span in `steps` steps (default: its length), re-reading the "
                      "whole sequence every step (no KV cache) and unmasking the most confident positions (plus every "
                      "one whose probability reaches `threshold`); `suffix_ids=` fills a span between a prefix and a "
                      "suffix."),
}


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if v is None:
        return "-"
    return str(v)


def _table(rows: list[tuple[str, object]], head=("", "")) -> str:
    lines = [f"| {head[0]} | {head[1]} |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in rows]
    return "\n".join(lines)


def render_card(config: dict, *, name: str, recipe: dict | None = None, training: dict | None = None,
                results: list[tuple[str, object]] | None = None, params: int | None = None,
                source: str | None = None) -> str:
    """Markdown model card from the export's config.json, the training recipe (RecipeConfig.to_dict),
    training facts (step, tokens seen, weights) and evaluation results [(metric, value)]."""
    sd = config.get("set_diffusion", {})
    spec = families.get(sd.get("family") or families.DEFAULT.name, "set_diffusion.family")
    family = spec.name
    tags = ["setdlm", "set-diffusion", family, "custom_code"]
    if not spec.next_token:
        tags.append("diffusion-language-model")
    tags = list(dict.fromkeys(tags))
    out = ["---", "library_name: transformers", "pipeline_tag: fill-mask", "tags:"]
    out += [f"- {t}" for t in tags]
    out += ["---", "", f"# {name}", ""]
    out.append(f"A {spec.description} language model trained with "
               f"setdlm and exported by `setdlm convert to-hf`. The modeling code ships with "
               "the weights (`trust_remote_code=True`); it needs only `torch` and `transformers`.")
    if source:
        out += ["", f"Converted from `{source}`."]
    window = spec.export_window(sd)
    out += ["", "## Usage", "", "```python", "import torch",
            "from transformers import AutoModelForMaskedLM, AutoTokenizer", "",
            'path = "PATH_OR_REPO"',
            "tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)",
            "model = AutoModelForMaskedLM.from_pretrained(path, trust_remote_code=True).eval()", ""]
    out.append('prompt = tok("The meaning of life is", add_special_tokens=False).input_ids')
    settings = f"window={window}, threshold=None" if spec.decoding == "set_window" else "threshold=None"
    out += [f"out = model.set_diffusion_generate([prompt], max_new_tokens=64, {settings})",
            "print(tok.decode(out.sequences[0]), out.tokens_per_step[0])"]
    out += ["", "# logits at given positions under a given attention pattern or mask (True = may attend):",
            "ids = torch.tensor([prompt])",
            f'logits = model(ids, position_ids=torch.arange(ids.shape[1])[None], attention_type="{spec.inference_mask}").logits',
            "```", ""]
    out.append(spec.card_usage or DECODING_USAGE[spec.decoding])
    arch = [("parameters", f"{params / 1e6:.1f}M" if params else None),
            ("layers", config.get("num_hidden_layers")), ("hidden size", config.get("hidden_size")),
            ("attention heads (KV heads)", f"{config.get('num_attention_heads')} ({config.get('num_key_value_heads')})"),
            ("head dim", config.get("head_dim")), ("MLP", f"{config.get('mlp_type')} x {config.get('intermediate_size')}"),
            ("norm", f"{config.get('norm_type')} (eps {config.get('norm_eps')})"), ("QK-norm", config.get("qk_norm")),
            ("rotary theta", config.get("rope_theta")), ("vocabulary (MASK id)", f"{config.get('vocab_size')} ({config.get('mask_token_id')})"),
            ("tied embeddings", config.get("tie_word_embeddings")), ("output-head bias", config.get("lm_head_bias")),
            ("weights dtype", config.get("dtype"))]
    out += ["", "## Model", "", _table(arch, ("field", "value"))]
    sched = [("family", family), ("sequence length L", sd.get("length"))]
    sched += spec.card_rows(sd)
    sched += [("MASK token id", sd.get("mask_token_id"))]
    out += ["", "## Set schedule", "", _table(sched, ("field", "value"))]
    out += _recipe_and_results(recipe, training, results, back=True)
    return "\n".join(out) + "\n"


def render_stock_card(config: dict, *, name: str, recipe: dict | None = None, training: dict | None = None,
                      results: list[tuple[str, object]] | None = None, params: int | None = None,
                      source: str | None = None) -> str:
    """Model card of an AR model exported in a stock architecture (hf_stock_export.py): plain
    transformers usage, no custom code."""
    arch = (config.get("architectures") or ["?"])[0]
    out = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", "- setdlm", "- ar",
           f"- {config.get('model_type')}", "---", "", f"# {name}", "",
           f"An autoregressive language model fine-tuned with setdlm and exported by `setdlm convert to-hf` as a "
           f"stock `{config.get('model_type')}` model (`{arch}`): it loads without `trust_remote_code`."]
    if source:
        out += ["", f"Converted from `{source}`."]
    out += ["", "## Usage", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            'path = "PATH_OR_REPO"', "tok = AutoTokenizer.from_pretrained(path)",
            "model = AutoModelForCausalLM.from_pretrained(path).eval()",
            'ids = tok("The meaning of life is", return_tensors="pt").input_ids',
            "print(tok.decode(model.generate(ids, max_new_tokens=64)[0]))", "```", ""]
    rows = [("parameters", f"{params / 1e6:.1f}M" if params else None), ("architecture", arch),
            ("layers", config.get("num_hidden_layers")), ("hidden size", config.get("hidden_size")),
            ("attention heads (KV heads)", f"{config.get('num_attention_heads')} ({config.get('num_key_value_heads')})"),
            ("head dim", config.get("head_dim")), ("vocabulary", config.get("vocab_size")),
            ("tied embeddings", config.get("tie_word_embeddings")), ("weights dtype", config.get("dtype"))]
    out += ["## Model", "", _table(rows, ("field", "value")),
            "", "The tokenizer has setdlm's MASK token; the model never predicts it in training, but as a stock "
            "architecture it has no -inf bias on it."]
    out += _recipe_and_results(recipe, training, results, back=False)
    return "\n".join(out) + "\n"


def _recipe_and_results(recipe, training, results, *, back: bool) -> list[str]:
    out: list[str] = []
    if recipe or training:
        out += ["", "## Training recipe", ""]
        rows: list[tuple[str, object]] = []
        t = dict(training or {})
        rows += [(k, v) for k, v in t.items()]
        if recipe:
            d, tr, p = recipe.get("data", {}), recipe.get("train", {}), recipe.get("parallel", {})
            rows += [_data_source(d), ("tokenizer", d.get("tokenizer")), ("sequence length", d.get("seq_len")),
                     ("global batch (micro batch)", f"{tr.get('global_batch')} ({tr.get('micro_batch')})"),
                     ("max steps", tr.get("max_steps")), ("optimizer", f"AdamW, lr {tr.get('lr')}, betas "
                                                                        f"({tr.get('beta1')}, {tr.get('beta2')}), weight decay {tr.get('weight_decay')}"),
                     ("LR schedule", f"{tr.get('lr_schedule')} after {tr.get('warmup_steps')} warm-up steps"),
                     ("grad clip", tr.get("grad_clip")), ("EMA decay", tr.get("ema")), ("precision", tr.get("precision")),
                     ("dropout", recipe.get("model", {}).get("dropout")),
                     ("layout", f"tp {p.get('tp')}, pp {p.get('pp')}, ZeRO-{p.get('zero_stage')}"),
                     ("seed", recipe.get("run", {}).get("seed"))]
            if tr.get("lora"):
                lo = tr["lora"]
                rows.append(("LoRA", f"rank {lo.get('rank')}, alpha {lo.get('alpha')} on {', '.join(lo.get('targets', []))}"))
        out.append(_table(rows, ("field", "value")))
        if recipe:
            out += ["", "The full recipe is in `setdlm_recipe.json`" + (
                "; `setdlm convert from-hf` turns this directory back into a training run." if back else
                "; `train.init_from` continues training from this directory.")]
    out += ["", "## Evaluation", ""]
    if results:
        out.append(_table(results, ("metric", "value")))
    else:
        out.append("No evaluation results were recorded with this checkpoint.")
    return out


def _data_source(data: dict) -> tuple[str, object]:
    """The recipe's data row: its source, or a mixture's sources with their weights and shares."""
    mixture = data.get("mixture") or []
    if not mixture:
        return "data source", data.get("source")
    entries = [MixtureEntry(**e) for e in mixture]
    total = sum(e.weight for e in entries)
    return "data mixture (weight, share)", "; ".join(
        f"{e.label}: `{e.source}` ({_fmt(e.weight)}, {e.weight / total:.1%})" for e in entries)


__all__ = ["DECODING_USAGE", "render_card", "render_stock_card"]
