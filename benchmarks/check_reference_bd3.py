"""BD3-LM decoding against the reference implementation (kuleshov-group/setdlms) on a tiny random release in
its Qwen3-backbone format: the issue-38 acceptance check `released-bd3-decode` reproduced without its trained
model. Two steps, two Python environments (the reference pins transformers 4.52; this project runs a newer
one), one JSON file between them:

    # 1. this project's environment: write a release (tests/release_fixtures.py: a stock transformers Qwen3 with
    #    moved weights), import it with `from-reference`, decode greedily (B = 4, one token per step)
    .venv/bin/python benchmarks/check_reference_bd3.py ours --out /tmp/bd3check [--length 128] [--new 40]
    # 2. an environment with the reference's requirements (torch, transformers==4.52.4, hydra-core, einops,
    #    tqdm) and a checkout of its code (never part of this repository): decode the same prompts with its
    #    cached block decoder and compare
    REFENV/bin/python benchmarks/check_reference_bd3.py reference --out /tmp/bd3check --src SETDLMS_CHECKOUT

The reference decodes with the generation settings of its evaluation scripts: `predict_and_noise`,
confidence-based noising, first hitting, `align_inputs_to_blocks` (whole prompt blocks cached, the first
block starting at B * floor(P / B)), greedy. Prompts of 17, 24 and 31 tokens (three each, random GPT-2
ids); the outputs are compared over the reference's output length (it returns max_new - (P mod B) tokens
when the prompt ends mid-block; docs/sampling.md, BD3-LM). The base model's config.json is given to the
reference with `rope_theta` at the top level, where transformers 4.52 reads it (the newer transformers
that writes the fixture puts it under `rope_parameters`; 4.52 would fall back to 10,000).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (17, 17, 17, 24, 24, 24, 31, 31, 31)


def ours(args) -> int:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import torch

    import release_fixtures as rf
    from model.sampling import SamplingConfig, generate
    from pretrain.checkpoint.inference import load_model
    from pretrain.convert.from_reference import import_reference

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    torch.set_num_threads(1)
    base = rf.base_model(out / "base")
    release = rf.write_release(out / "bd3lm-release", rf.trained_backbone(base, seed=1),
                               rf.release_config("bd3lm", args.length, base=str(base), block=4))
    run = import_reference(release, out / "run", base_model=str(base), log=lambda s: None)
    model, _, cfg = load_model(run)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, 50256, (n,), generator=g).tolist() for n in LENGTHS]
    sc = SamplingConfig(family="bd3lm", block_size=4, max_new_tokens=args.new, stop_on_eos=False)
    tokens = [o.tokens for o in generate(model, prompts, sc)]
    (out / "ours.json").write_text(json.dumps({"release": str(release), "base": str(base), "new": args.new,
                                               "prompts": prompts, "ours": tokens}))
    print(f"imported {cfg.objective.name} (block {cfg.objective.block_size}, L {args.length}); decoded "
          f"{len(prompts)} prompts -> {out / 'ours.json'}")
    return 0


def reference(args) -> int:
    sys.path.insert(0, str(Path(args.src).resolve()))
    import torch
    from transformers import PreTrainedTokenizerFast

    from src.denoiser.bd3lm import BD3LM, BD3LMConfig
    from src.denoiser.diffusion_config import DiffusionGenerationConfig

    out = Path(args.out)
    d = json.loads((out / "ours.json").read_text())
    release = Path(d["release"])
    cfg = json.loads((release / "config.json").read_text())
    base = out / "base-transformers-4.52"
    if not base.exists():
        shutil.copytree(d["base"], base)
        bc = json.loads((base / "config.json").read_text())
        bc.setdefault("rope_theta", (bc.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        (base / "config.json").write_text(json.dumps(bc))
    # the reference's own modules in place of the release's copied ones
    cfg["backbone_config"].update(_target_="src.backbone.automodel.AutoModelFromPreTrained",
                                  pretrained_model_name_or_path=str(base))
    cfg["noise_config"]["_target_"] = "src.noise_schedule.noise_schedules.LinearNoise"
    for k in ("architectures", "auto_map", "transformers_version", "model_type"):
        cfg.pop(k, None)
    torch.set_num_threads(1)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(release / "tokenizer.json"))
    model = BD3LM(BD3LMConfig(**cfg), tokenizer=tok)
    missing, unexpected = model.load_state_dict(torch.load(release / "pytorch_model.bin", weights_only=True),
                                                strict=False)
    missing = [k for k in missing if "static_attention_mask" not in k]
    if missing or unexpected:
        print(f"weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
        return 1
    model.eval()
    gc = DiffusionGenerationConfig(num_steps=1000, min_t=1e-5, block_size=4, first_hitting=True,
                                   sampling_strategy="predict_and_noise", noise_removal=False,
                                   confidence_based_noising=True, confidence_threshold=1e6,
                                   align_inputs_to_blocks=True, nucleus_p=1.0, do_sample=False, use_cache=True,
                                   pad_token_id=cfg["mask_token_id"])
    same = 0
    for p, a in zip(d["prompts"], d["ours"]):
        r = model.generate(inputs=torch.tensor([p]), generation_config=gc, max_new_tokens=d["new"], device="cpu",
                           disable_pbar=True)[0, len(p):].tolist()
        ok = a[: len(r)] == r
        same += ok
        first = next((i for i in range(len(r)) if a[i] != r[i]), None)
        print(f"prompt of {len(p)} tokens: the reference returns {len(r)} tokens, this project {len(a)}; "
              f"{'identical' if ok else f'different from token {first}'} over the reference's length")
    print(f"released-bd3-decode: {same}/{len(d['prompts'])} identical")
    return 0 if same == len(d["prompts"]) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("side", choices=["ours", "reference"])
    p.add_argument("--out", required=True, help="working directory (the release, the run, the JSON)")
    p.add_argument("--src", help="reference: a checkout of kuleshov-group/setdlms (its src/ package)")
    p.add_argument("--length", type=int, default=128, help="ours: the release's length L (>= 31 + --new)")
    p.add_argument("--new", type=int, default=40, help="ours: new tokens per prompt")
    p.add_argument("--seed", type=int, default=0, help="ours: seed of the random prompts")
    args = p.parse_args(argv)
    if args.side == "reference" and not args.src:
        p.error("reference: --src (a checkout of kuleshov-group/setdlms) is required")
    return ours(args) if args.side == "ours" else reference(args)


if __name__ == "__main__":
    sys.exit(main())
