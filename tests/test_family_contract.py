"""The family contract: every registered family (`families.names()`, model/families) is checked here the
same way, so a family added by its module and one registry line is tested with no other edit:

- its class paths resolve and its traits are ones the stack and the exported code know;
- its likelihood bound equals the exact value by enumeration on a tiny case (tests/exact_bounds.py);
- its cached decoder equals the recomputing reference decoder (a decoder without a cache: batched
  decoding equals one prompt at a time);
- a 2-step training run, resumed from its step-1 checkpoint, logs the same step-2 loss, and samples;
- its Hugging Face export gives the package's logits and greedy tokens in a process that imports only
  transformers and the exported files (one process for every family at once);
- `--describe` and the commands' choices list it;
- every activation and norm choice of model/config.py exports with parity;
- a toy family registered the documented way in a scratch copy of the repository passes this contract
  (trains, resumes, samples, exports) with the layout and option tests.

And two guards: at most 2 lines of the library and tests spell three or more family names, and no file of
the exported code (model/convert/hf_code/) names a family.

SETDLM_CONTRACT_ONLY=NAME[,NAME] restricts the parametrised checks to those families (the toy-family
test runs the contract so in its scratch copy).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from helpers import REPO, cli_env, read_metrics, run_as_of, run_transformers_only, tiny_tokenizer, write_recipe
from model import families

ONLY = [n for n in os.environ.get("SETDLM_CONTRACT_ONLY", "").split(",") if n]
NAMES = tuple(n for n in families.names() if not ONLY or n in ONLY)
assert NAMES, f"SETDLM_CONTRACT_ONLY={ONLY} names no registered family ({', '.join(families.names())})"

# Architectures cycled over the families (by registration order), so every mapping path of the export
# is exercised: LayerNorm + bias + GELU + tied; RMSNorm + SwiGLU + GQA + QK-norm untied; untied without
# bias; an output-head bias.
ARCHS = ({}, {"norm": "rmsnorm", "activation": "swiglu", "n_heads": 4, "n_kv_heads": 2, "qk_norm": True,
              "bias": False, "tie_embeddings": False, "ffn_hidden": 48},
         {"bias": False, "tie_embeddings": False, "n_layers": 2}, {"tie_embeddings": False, "head_bias": True, "n_heads": 4})
# init_std 0.5: peaked enough for thresholds to matter, never saturated (probabilities of exactly 1.0 in
# float32 tie between positions, and the package and the export may round them apart)
TINY = {"n_layers": 1, "hidden": 32, "n_heads": 2, "ffn_hidden": 64, "max_seq_len": 32, "vocab_pad_multiple": 8,
        "init_std": 0.5, "dropout": 0.0}
SEQ = 16


def _arch(name: str) -> dict:
    return ARCHS[families.names().index(name) % len(ARCHS)]


def _choices(field: str) -> tuple:
    from model.config import ModelConfig

    return typing.get_args(typing.get_type_hints(ModelConfig)[field])


BLOCK_CHOICES = [("activation", a) for a in _choices("activation")] + [("norm", n) for n in _choices("norm")]


# -- the spec itself ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_class_paths_resolve_and_traits_are_known(name):
    from model.config import ObjectiveConfig
    from model.convert.hf_code import configuration_setdlm as hf
    from model.masks import MASK_KINDS
    from model.objectives.base import Objective
    from model.sampling.engine import Decoder
    from model.sampling.reference import Reference

    spec = families.get(name)
    assert issubclass(spec.objective_class(), Objective)
    assert issubclass(spec.decoder_class(), Decoder)
    assert spec.mask_kind in MASK_KINDS and spec.clean_text_mask in MASK_KINDS
    assert spec.inference_mask in hf.INFERENCE_MASKS and spec.decoding in hf.DECODING_MODES
    assert set(spec.objective_keys) <= set(ObjectiveConfig.__dataclass_fields__)
    if spec.reference_step:
        assert callable(getattr(Reference, spec.reference_step))
    else:  # only a decoder without a cache has nothing to recompute
        assert spec.rereads_sequence, f"{name}: reference_step names no recomputing reference decoder step"
    lay = spec.layout(8, 2)
    assert lay.tokens_in == (16 if spec.two_stream else 8) and lay.mask_kind == spec.mask_kind
    assert name in typing.get_args(typing.get_type_hints(ObjectiveConfig)["name"])  # objective.name takes it


def test_the_exported_code_knows_the_same_traits():
    from model.convert.hf_code import configuration_setdlm as hf

    assert families.INFERENCE_MASKS == hf.INFERENCE_MASKS
    assert families.DECODING_MODES == hf.DECODING_MODES


def test_a_registration_mistake_is_one_line():
    from model.families.spec import FamilySpec

    class Bad(FamilySpec):
        name, objective_path, decoder_path, decoding = "bad", "m:O", "m:D", "beam"

    with pytest.raises(ValueError, match=r"^model/families: Bad\.decoding: one of next_token, .* got 'beam'$"):
        families._index([Bad()])
    with pytest.raises(ValueError, match="two registered families are named"):
        families._index([families.get(NAMES[0]), families.get(NAMES[0])])


# -- the bound -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_bound_equals_exact_enumeration(name):
    from exact_bounds import exact_bound, mc_bound
    from model.config import ModelConfig, ObjectiveConfig
    from model.objectives import build_objective
    from model.transformer import Transformer

    spec = families.get(name)
    L, V = (4, 12) if spec.order_mixture else (6, 12)  # orders: L! of them
    torch.manual_seed(1)
    model = Transformer(ModelConfig(n_layers=1, hidden=16, n_heads=2, ffn_hidden=32, vocab_size=V, mask_id=V - 1,
                                    dropout=0.0, max_seq_len=16, init_std=0.5)).eval()
    obj = build_objective(ObjectiveConfig(name=name, set_size=2, block_size=2), model.cfg, L)
    x = torch.randint(0, V - 1, (1, L), generator=torch.Generator().manual_seed(3))
    exact = exact_bound(spec, obj, model, x)
    assert exact is not None, (f"{name}: tests/exact_bounds.py has no enumeration for a bound with these traits "
                               f"(exact_likelihood, bound_masks_subset, order_mixture); add one")
    mean, se, vals = mc_bound(model, obj, x, 2 if spec.exact_likelihood else 4000)
    if spec.exact_likelihood:
        assert abs(mean - exact) < 1e-4 * exact, (mean, exact)
    else:
        assert abs(mean - exact) < 4 * se + 2e-4 * exact, (mean, se, exact)
        assert se < 0.02 * exact  # enough draws for the check to have teeth


# -- decoding --------------------------------------------------------------------------------------
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]


@pytest.mark.parametrize("name", NAMES)
def test_cached_decoder_equals_the_recomputing_reference(name, one_thread):
    from model.sampling import Infill, SamplingConfig, generate
    from model.sampling.reference import generate_reference
    from model.sampling.testing import tiny_model

    model = tiny_model(seed=1)
    spec = families.get(name)
    infill = [Infill([1, 2, 3], 6, [7, 8, 9]), Infill([4], 5, [5, 6])]
    for kw in ({}, {"threshold": 0.5}):
        cfg = SamplingConfig(family=name, max_new_tokens=9, **kw)
        for prompts in (PROMPTS, infill):
            out = [(o.tokens, o.commit_step, o.steps, o.sequence) for o in generate(model, prompts, cfg)]
            if spec.reference_step:
                ref = generate_reference(model, prompts, cfg)
            else:  # no cache: every step re-reads the sequence; batched rows must not see each other
                ref = [generate(model, [p], cfg)[0] for p in prompts]
            assert out == [(o.tokens, o.commit_step, o.steps, o.sequence) for o in ref], (name, kw)


# -- training ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_parallel):
    """Per family: a 2-step run (checkpoints at 1 and 2) and the same run resumed from its step-1
    checkpoint (helpers.run_as_of): {name: (uninterrupted, resumed)}."""
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    tmp = tmp_path_factory.mktemp("contract_train")
    out = {}
    for name in NAMES:
        recipe = write_recipe(tmp / f"{name}.yaml", objective={"name": name}, run={"name": name},
                              train={"max_steps": 2, "save_every": 1, "eval_every": 2, "eval_batches": 1,
                                     "log_every": 1, "warmup_steps": 1, "sample_at_end": False})
        Trainer(load_config(recipe, [f"run.out_dir={tmp / 'a'}"])).train()
        resumed = run_as_of(tmp / "a" / name, tmp / "b" / name, 1)
        Trainer(load_config(recipe, [f"run.out_dir={tmp / 'b'}"])).train()
        out[name] = (tmp / "a" / name, resumed)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_two_steps_train_resume_and_sample(trained, name):
    from model.sampling import SamplingConfig, generate
    from pretrain.checkpoint.inference import load_model

    a, b = trained[name]
    ma, mb = read_metrics(a), read_metrics(b)
    assert mb[2]["train/loss"] == ma[2]["train/loss"] and mb[2]["val/nll"] == ma[2]["val/nll"]
    assert (b / "checkpoints" / "latest").read_text() == "step_00000002"
    model, tok, cfg = load_model(b)
    assert cfg.objective.name == name
    sc = SamplingConfig.from_objective(cfg.objective, max_new_tokens=6, stop_on_eos=False)
    outs = generate(model, [tok.encode("The for statement"), tok.encode("A")], sc, mask_id=tok.mask_id,
                    eos_id=tok.eos_id)
    assert [len(o.tokens) for o in outs] == [6, 6] and all(o.steps >= 1 for o in outs)
    assert all(0 <= t < tok.vocab_size and t != tok.mask_id for o in outs for t in o.tokens)


# -- exports ----------------------------------------------------------------------------------------
HF_SCRIPT = r'''
import importlib.abc, sys, torch

class Block(importlib.abc.MetaPathFinder):  # the export must not need setdlm
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"model", "pretrain", "data_pipeline", "eval", "serve", "launch", "common"}:
            raise ImportError(f"blocked import of setdlm package {name}")
sys.meta_path.insert(0, Block())
from transformers import AutoModelForMaskedLM

jobs = torch.load(sys.argv[1])
out = {}
for name, job in jobs.items():
    m = AutoModelForMaskedLM.from_pretrained(job["dir"], trust_remote_code=True).eval()
    sd = getattr(m.config, "set_diffusion", {})  # an export of format 1 has no traits
    r = {"traits": (sd.get("inference_mask"), sd.get("decoding"))}
    with torch.no_grad():
        r["logits"] = m(job["ids"], position_ids=job["pos"], attention_mask=job["mask"]).logits
        r["default"] = m(job["plain"]).logits  # the inference mask of config.json
    for key, kw in job.get("decode", {}).items():
        g = m.set_diffusion_generate(**kw)
        r[key] = (g.sequences, g.steps)
    out[name] = r
torch.save(out, sys.argv[2])
'''


def run_hf(jobs: dict, tmp: Path) -> dict:
    """`jobs` run by HF_SCRIPT in a process that imports transformers and the exported files only."""
    return run_transformers_only(HF_SCRIPT, jobs, tmp, timeout=600)


def _decode_cases(spec, prompts, infill, limit: int) -> dict:
    """Greedy cases per family: {key: (SamplingConfig overrides, set_diffusion_generate kwargs)}."""
    from model.sampling import Infill

    cases = {"plain": ({}, {}), "threshold": ({"threshold": 0.5}, {"threshold": 0.5})}
    steps_key = {"block": "steps_per_block", "full_sequence": "steps"}.get(spec.decoding)
    if steps_key:  # fewer steps than positions: several commits per step
        cases["steps"] = ({steps_key: 2}, {"steps": 2})
    cases = {k: (dict(sc, max_new_tokens=9), dict(kw, input_ids=prompts, max_new_tokens=9))
             for k, (sc, kw) in cases.items()}
    cases["infill"] = ({"max_new_tokens": 7},
                       {"input_ids": [infill.prefix], "suffix_ids": [infill.suffix], "max_new_tokens": infill.length})
    if not spec.rereads_sequence:  # past the model's positions: the oldest cached tokens are dropped
        cases["overflow"] = ({"max_new_tokens": limit + 6, "stop_on_eos": False},
                             {"input_ids": prompts, "max_new_tokens": limit + 6, "stop_on_eos": False})
    for sc, kw in cases.values():
        sc["infill"] = "suffix_ids" in kw
    return cases, Infill


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Random tiny models of every family (and of every activation and norm choice, under the default
    family) written as runs, exported, and run by one transformers-only process; the package's logits
    and greedy tokens beside them. {key: {"hf": ..., "ref_logits": ..., "ref_default": ..., "decode": ...}}"""
    from model.masks import build_mask
    from model.objectives import build_objective
    from model.sampling import Infill, SamplingConfig, generate
    from model.transformer import Transformer, full_logits
    from pretrain.checkpoint.inference import load_model
    from pretrain.config import load_config
    from pretrain.convert.export import export_checkpoint
    from pretrain.convert.from_hf import write_run

    tmp = tmp_path_factory.mktemp("contract_export")
    tok = tiny_tokenizer(tmp / "tok")
    models = {f"family:{n}": (n, _arch(n)) for n in NAMES}
    if not ONLY:  # a block choice no family's architecture has: its own export under the default family
        from model.config import ModelConfig

        had = {(field, getattr(ModelConfig(**{**TINY, **arch, "vocab_size": 32, "mask_id": 31}), field))
               for _, arch in models.values() for field in ("activation", "norm")}
        models.update({f"{field}:{v}": (families.DEFAULT.name, {field: v}) for field, v in BLOCK_CHOICES
                       if (field, v) not in had})
    jobs, w = {}, {}
    prompts = [tok.encode("the cat sat on"), tok.encode("a big red dog ran far and")]
    infill = Infill(tok.encode("one small cat"), 7, tok.encode("on the mat ."))
    for i, (key, (name, arch)) in enumerate(models.items()):
        spec = families.get(name)
        recipe = write_recipe(tmp / "r.yaml", model={**TINY, **arch}, objective={"name": name, "set_size": 4},
                              data={"tokenizer": str(tmp / "tok"), "seq_len": SEQ})
        cfg = load_config(recipe, [f"run.out_dir={tmp}"])
        cfg.resolve_vocab(tok)
        torch.manual_seed(i)
        run = write_run(tmp / f"run{i}", cfg, Transformer(cfg.model).state_dict(), tok, info={}, log=lambda s: None)
        export = export_checkpoint(run, tmp / f"hf{i}", log=lambda s: None)
        model, _, c = load_model(run)
        obj = build_objective(c.objective, c.model, SEQ)
        g = torch.Generator().manual_seed(11)
        x = torch.randint(0, c.model.mask_id, (2, SEQ), generator=g)
        inp = obj.prepare({"input_ids": x}, g)
        plain = x[:1, :12]
        block = int(json.loads((export / "config.json").read_text())["set_diffusion"]["block_size"])
        default_mask = _inference_mask(spec.inference_mask, 12, block) if spec.inference_mask != "causal" else \
            build_mask("causal", 12)
        with torch.no_grad():
            ref = full_logits(model, model(inp.input_ids, inp.position_ids, inp.attn_mask))
            ref_default = full_logits(model, model(plain, torch.arange(12)[None], default_mask))
        w[key] = {"ref_logits": ref, "ref_default": ref_default, "config": json.loads((export / "config.json").read_text())}
        job = {"dir": str(export), "ids": inp.input_ids, "pos": inp.position_ids, "mask": inp.attn_mask, "plain": plain}
        if key.startswith("family:"):
            cases, _ = _decode_cases(spec, prompts, infill, c.model.max_seq_len)
            w[key]["decode"] = {}
            for case, (sc, kw) in cases.items():
                is_infill = sc.pop("infill")
                cfg_s = SamplingConfig.from_objective(c.objective, **sc)
                # one prompt at a time, as the export decodes (batched rows agree only up to float rounding)
                outs = [generate(model, [p], cfg_s, mask_id=tok.mask_id, eos_id=tok.eos_id)[0]
                        for p in ([infill] if is_infill else prompts)]
                w[key]["decode"][case] = ([o.tokens for o in outs], [o.steps for o in outs])
            job["decode"] = {case: kw for case, (_, kw) in cases.items()}
        jobs[key] = job
    hf = run_hf(jobs, tmp)
    for key in w:
        w[key]["hf"] = hf[key]
    return w


def _inference_mask(kind: str, length: int, block: int) -> torch.Tensor:
    """The one-stream attention an export's forward uses by default (its config's inference_mask)."""
    i = torch.arange(length)
    if kind == "bidirectional":
        return torch.ones(length, length, dtype=torch.bool)
    if kind == "block_causal":
        return (i[:, None] // block) >= (i[None, :] // block)
    raise AssertionError(f"no reference for inference mask {kind!r}")


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    assert torch.equal(fa, fb), "MASK/-inf logits differ"
    diff = (a[fa] - b[fb]).abs().max().item()
    assert diff <= tol, f"max |logit difference| {diff:.3g} > {tol}"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_export_parity_in_a_transformers_only_process(exported, name):
    spec = families.get(name)
    w = exported[f"family:{name}"]
    sd = w["config"]["set_diffusion"]
    assert (sd["family"], sd["inference_mask"], sd["decoding"]) == (name, spec.inference_mask, spec.decoding)
    assert w["hf"]["traits"] == (spec.inference_mask, spec.decoding)
    _close(w["hf"]["logits"], w["ref_logits"])
    _close(w["hf"]["default"], w["ref_default"])
    for case, ref in w["decode"].items():
        assert w["hf"][case] == ref, (name, case, w["hf"][case], ref)
    tokens, steps = w["decode"]["threshold"]
    if spec.decoding != "next_token":  # the threshold accepted several tokens in one step somewhere
        assert any(len(t) > s for t, s in zip(tokens, steps)), (name, tokens, steps)


@pytest.mark.slow
@pytest.mark.parametrize("field,choice", BLOCK_CHOICES)
def test_every_activation_and_norm_choice_exports_with_parity(exported, field, choice):
    if ONLY:
        pytest.skip("SETDLM_CONTRACT_ONLY: block choices are checked in the full contract")
    key = f"{field}:{choice}"
    if key not in exported:  # exported as some family's architecture
        key = next(k for k, v in exported.items() if v["config"][{"activation": "mlp_type", "norm": "norm_type"}[field]] == choice)
    w = exported[key]
    cfg = w["config"]
    assert cfg[{"activation": "mlp_type", "norm": "norm_type"}[field]] == choice
    _close(w["hf"]["logits"], w["ref_logits"])
    _close(w["hf"]["default"], w["ref_default"])


# -- the commands list it -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_describe_and_the_commands_choices_list_it(name, capsys):
    from common.options import option_rows
    from eval import api
    from eval.sample import SampleOptions
    from launch.cli import main

    assert main(["pretrain", "--describe", "objective"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["objective.name"])
    assert re.search(rf"\b{name}\b", row), row
    for cls in (SampleOptions, api.options_class("gsm8k")):
        rows = {flag: typ for flag, typ, _, _ in option_rows(cls)}
        assert name in rows["--family"].split(" | "), rows["--family"]
    from pretrain.convert.cli import build_parser as convert_parser

    action = next(a for p in _subparsers(convert_parser()) for a in p._actions if "--family" in a.option_strings)
    assert name in action.choices
    schema = pytest.importorskip("serve.schema")
    assert name in typing.get_args(typing.get_args(schema.Extension.model_fields["family"].annotation)[0])


def _subparsers(parser):
    import argparse

    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            yield from a.choices.values()


# -- guards -----------------------------------------------------------------------------------------
def _quoted_names(line: str, names) -> set:
    return {n for n in names if re.search(rf"""["'`]{re.escape(n)}["'`]""", line)}


def lines_spelling_families(root: Path = REPO, at_least: int = 3) -> list[str]:
    """Lines of the library and tests (every .py file of the repository) that spell `at_least` family
    names by hand, as quoted strings: the lists a new family would have to be added to."""
    names = families.names()
    skip = {".venv", ".git", "runs", "wheels", "node_modules", "__pycache__"}
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip and not x.startswith("."))
        for f in sorted(x for x in files if x.endswith(".py")):
            p = Path(d) / f
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
                if len(_quoted_names(line, names)) >= at_least:
                    out.append(f"{p.relative_to(root)}:{i}: {line.strip()}")
    return out


def test_at_most_two_lines_spell_three_family_names():
    found = lines_spelling_families()
    assert len(found) <= 2, "lines that list families by hand (ask the registry, families.names()):\n" + "\n".join(found)


def test_the_exported_code_names_no_family():
    """The exported code acts on the inference traits of config.json, never on a family's name or title
    (the architecture's own name, model_type "setdlm", is not a family's)."""
    from model.convert.hf_config import CODE_FILES, HF_CODE_DIR

    words = {s.name for s in families.REGISTERED} | {s.title for s in families.REGISTERED}
    found = []
    for f in CODE_FILES:
        for i, line in enumerate((HF_CODE_DIR / f).read_text().splitlines(), 1):
            if re.fullmatch(r'\s*model_type = "setdlm"', line):
                continue
            hits = _quoted_names(line, words) | {w for w in words if w != "setdlm" and re.search(
                rf"(?<![\w-]){re.escape(w)}(?![\w-])", line)}
            if hits:
                found.append(f"{f}:{i}: {sorted(hits)}: {line.strip()}")
    assert not found, "\n".join(found)


# -- a new family, added the documented way -----------------------------------------------------------
TOY_OBJECTIVE = '''"""MDLM trained on its ELBO: the masked cross-entropy weighted by 1/t (t ~ U[eps, 1])."""

from __future__ import annotations

from .mdlm import MaskedDiffusionObjective


class ElboObjective(MaskedDiffusionObjective):
    def prepare(self, batch, generator=None, bound: bool = False):
        inp = super().prepare(batch, generator, bound)
        if not bound:
            inp.loss_weight = inp.loss_weight / inp.extra["t"][:, None]
        return inp
'''
TOY_SPEC = '''"""MDLM-ELBO: masked diffusion whose training loss is the 1/t-weighted ELBO (decodes as MDLM)."""

from __future__ import annotations

from .mdlm import MaskedDiffusionFamily


class ElboFamily(MaskedDiffusionFamily):
    name = "mdlm_elbo"
    title = "MDLM-ELBO"
    description = "masked diffusion trained on its 1/t-weighted ELBO"
    objective_path = "model.objectives.mdlm_elbo:ElboObjective"
    reference_names = ()


SPEC = ElboFamily()
'''


def add_toy_family(repo: Path) -> None:
    """What docs/architecture.md "Adding a family" says a newcomer touches: the objective's module, the
    family's module and one line in the registry."""
    (repo / "model" / "objectives" / "mdlm_elbo.py").write_text(TOY_OBJECTIVE)
    (repo / "model" / "families" / "mdlm_elbo.py").write_text(TOY_SPEC)
    reg = repo / "model" / "families" / "__init__.py"
    lines = reg.read_text().splitlines(keepends=True)
    end = lines.index(")\n", lines.index("MODULES = (\n"))
    reg.write_text("".join(lines[:end] + ['    "mdlm_elbo",\n'] + lines[end:]))


def test_the_docs_list_what_the_toy_family_touches():
    """docs/architecture.md "Adding a family" names exactly the three places add_toy_family writes."""
    doc = (REPO / "docs" / "architecture.md").read_text().split("### Adding a family", 1)[1].split("###", 1)[0]
    steps = re.findall(r"^(\d)\. (.*)$", doc, re.M)
    assert [n for n, _ in steps] == ["1", "2", "3"], steps
    assert "`model/objectives/xyz.py`" in steps[0][1] and "`model/families/xyz.py`" in steps[1][1]
    assert '`"xyz",` in `MODULES` in `model/families/__init__.py`' in steps[2][1]


@pytest.mark.slow
def test_a_toy_family_added_the_documented_way_passes_the_contract(tmp_path):
    if ONLY:
        pytest.skip("already inside a scratch copy")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    repo = tmp_path / "repo"
    for f in files:
        if (REPO / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, repo / f)
    add_toy_family(repo)
    env = cli_env()
    env.update(PYTHONPATH=str(repo), SETDLM_CONTRACT_ONLY="mdlm_elbo")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "tests/test_family_contract.py", "tests/test_layout_doc.py", "tests/test_eval_options.py"],
                       cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) >= 10, r.stdout[-2000:]
    assert "mdlm_elbo" in subprocess.run([sys.executable, "-c", "from model import families; print(families.names())"],
                                         cwd=repo, env=env, capture_output=True, text=True).stdout
