"""`setdlm convert from-reference` on the reference implementation's pretrained-backbone releases (the
paper's GSM8K / CNN-DM format), with fixtures built here from a stock transformers Qwen3 (release_fixtures.py):
logits against transformers' own Qwen3 forward under the two-stream mask, the recorded first-hitting cache
order as every decoder's default (checked against the recomputing reference decoder in both modes), the
other families, truncation, routing from from-hf / init_from, and bad input as one line with exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import release_fixtures as rf
from helpers import REPO, cli_env

L = 48  # the releases' length (the paper's is 1024)


@pytest.fixture(scope="module")
def fx(tmp_path_factory, one_thread):
    """Base models (tied, untied), release directories of each family, and their imported runs."""
    from pretrain.convert.from_reference import import_reference

    tmp = tmp_path_factory.mktemp("release")
    out = {"tmp": tmp, "base": rf.base_model(tmp / "base"),
           "base_untied": rf.base_model(tmp / "base_untied", tie=False)}
    out["bb"] = rf.trained_backbone(out["base"])
    out["bb_untied"] = rf.trained_backbone(out["base_untied"], seed=2)
    out["setdlm"] = rf.write_release(tmp / "setdlm-gsm8k-smax8", out["bb"], rf.release_config("setdlm", L))
    out["run"] = import_reference(out["setdlm"], tmp / "run", base_model=str(out["base"]), log=lambda s: None)
    return out


def _ours(run, ids, pos, kind):
    from model.masks import build_mask
    from model.transformer import full_logits
    from pretrain.checkpoint.inference import load_model

    model, tok, cfg = load_model(run)
    T = ids.shape[1]
    mask = build_mask(kind, T // 2 if kind == "set_causal" else T)
    with torch.no_grad():
        return full_logits(model, model(ids, pos, mask)), mask, (model, tok, cfg)


def _close(ours, ref, mask_id):
    ref = ref.clone()
    ref[..., mask_id] = float("-inf")  # the MASK logit, -inf in ours (the reference forbids it the same way)
    V = ref.shape[-1]
    assert torch.isinf(ours[..., V:]).all()  # vocabulary padding only
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ours[..., :V]), fin)
    diff = (ours[..., :V][fin] - ref[fin]).abs().max().item()
    assert diff < 1e-4 * ref[fin].abs().max().item(), diff


def test_setdlm_release_logits_match_transformers_under_the_two_stream_mask(fx):
    ids, pos = rf.two_stream_inputs(L, 50257)
    ours, mask, (model, tok, cfg) = _ours(fx["run"], ids, pos, "set_causal")
    _close(ours, rf.transformers_logits(fx["bb"], ids, pos, mask), 50257)
    o, m = cfg.objective, cfg.model
    assert (o.name, o.set_size, o.s_max, o.cache_order, cfg.data.seq_len) == ("setdlm", 4, None, "first_hitting", L)
    assert (m.n_layers, m.hidden, m.vocab_size, m.mask_id, m.max_seq_len, m.tie_embeddings, m.dropout) == \
        (2, 128, rf.ROWS, 50257, L, True, 0.0)  # every embedding row kept: the reference decodes over all of them
    assert tok.mask_id == 50257 and tok.vocab_size == 50258
    assert not (fx["setdlm"] / "RAN").exists()  # the release's .py files never ran


@pytest.mark.slow
def test_untied_safetensors_release_and_the_other_families(fx, tmp_path):
    from pretrain.convert.from_reference import import_reference

    bb = fx["bb_untied"]
    ids = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(20).expand(2, 20)
    for family in ("ar", "bd3lm", "mdlm"):  # the reference's released families besides SW-SetDLM, not the registry
        d = rf.write_release(tmp_path / f"gsm8k-{family}", bb, rf.release_config(family, L, block=8),
                             safetensors=family == "mdlm")
        run = import_reference(d, tmp_path / f"run-{family}", base_model=str(fx["base_untied"]), log=lambda s: None)
        ours, mask, (_, _, cfg) = _ours(run, ids, pos, "causal")
        _close(ours, rf.transformers_logits(bb, ids, pos, mask), 50257)
        assert cfg.objective.name == family and not cfg.model.tie_embeddings
        assert cfg.objective.block_size == (8 if family == "bd3lm" else 4)


@pytest.mark.slow
def test_imported_bd3lm_release_decodes_prompts_of_every_length_mod_block(fx, tmp_path):
    """The reference's BD3-LM release format, imported, decoded greedily at B = 4 (one token per step) for
    prompts of 17, 24 and 31 tokens (the issue's lengths) and of every length mod B: the cached decoder equals
    the recomputing reference, whose partial prompt block is denoised with the span (docs/sampling.md,
    BD3-LM; the reference implementation itself, run beside this on such a release, gives the same tokens
    over its output length)."""
    from model.sampling import SamplingConfig, generate
    from model.sampling.reference import generate_reference
    from pretrain.checkpoint.inference import load_model
    from pretrain.convert.from_reference import import_reference

    d = rf.write_release(tmp_path / "gsm8k-bd3lm", fx["bb"], rf.release_config("bd3lm", L, block=4))
    model, _, cfg = load_model(import_reference(d, tmp_path / "run", base_model=str(fx["base"]), log=lambda s: None))
    assert (cfg.objective.name, cfg.objective.block_size) == ("bd3lm", 4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 50256, (n,), generator=g).tolist() for n in (17, 18, 24, 31)]
    sc = SamplingConfig(family="bd3lm", block_size=4, max_new_tokens=7, stop_on_eos=False)
    out = generate(model, prompts, sc)
    ref = generate_reference(model, prompts, sc)
    assert [(o.tokens, o.commit_step) for o in out] == [(o.tokens, o.commit_step) for o in ref]
    assert all(len(o.tokens) == 7 and o.steps == 7 for o in out)


@pytest.mark.slow
def test_truncated_release_keeps_the_layers_the_reference_keeps(fx, tmp_path):
    """num_layers=1 of the 2-layer base: the first layer (keep_top_layers: the last one), renumbered 0."""
    from transformers import Qwen3ForCausalLM

    from pretrain.convert.from_reference import import_reference

    ids, pos = rf.two_stream_inputs(L, 50257, seed=5)
    for top, keep in ((False, 0), (True, 1)):
        d = rf.write_release(tmp_path / f"r{keep}", fx["bb"],
                             rf.release_config("setdlm", L, num_layers=1, keep_top=top), layers=[keep])
        run = import_reference(d, tmp_path / f"run{keep}", base_model=str(fx["base"]), log=lambda s: None)
        ours, mask, (_, _, cfg) = _ours(run, ids, pos, "set_causal")
        conf = {**fx["bb"].config.to_dict(), "num_hidden_layers": 1}
        conf["layer_types"] = conf.get("layer_types", ["full_attention"])[:1]
        one = Qwen3ForCausalLM(fx["bb"].config.__class__(**conf))
        sd = {k.replace(f"layers.{keep}.", "layers.0."): v for k, v in fx["bb"].state_dict().items()
              if not k.startswith("model.layers.") or k.startswith(f"model.layers.{keep}.")}
        one.load_state_dict(sd)
        _close(ours, rf.transformers_logits(one.eval(), ids, pos, mask), 50257)
        assert cfg.model.n_layers == 1


@pytest.mark.parametrize("threshold", [0.9, 0.5, 0.0])
def test_recorded_cache_order_is_the_default_and_matches_the_recomputing_reference(fx, threshold):
    """generate() on load_model(RUN) with no option decodes in the release's first-hitting cache order, as the
    recomputing reference does; position order is the other mode, also checked; they differ somewhere."""
    from model.sampling import SamplingConfig, generate
    from model.sampling.reference import generate_reference
    from pretrain.checkpoint.inference import load_model

    model, tok, _ = load_model(fx["run"])
    prompts = [tok.encode(t) for t in ("The answer is", "Natalia sold clips to 48 of her friends", "x")]
    cfg = SamplingConfig(window=4, threshold=threshold, max_new_tokens=20, stop_on_eos=False)
    differ = 0
    for p in prompts:
        torch.manual_seed(11)
        default = generate(model, [p], cfg)[0].tokens
        torch.manual_seed(11)
        fht = generate_reference(model, [p], cfg, cache_order="first_hitting")[0].tokens
        assert default == fht
        pos = generate(model, [p], cfg, cache_order="position")[0]
        assert pos.tokens == generate_reference(model, [p], cfg, cache_order="position")[0].tokens
        differ += pos.tokens != default
    batch = [o.tokens for o in generate(model, prompts, SamplingConfig(window=4, threshold=threshold, max_new_tokens=20,
                                                                       stop_on_eos=False, seed=3))]
    assert batch == [generate(model, [p], SamplingConfig(window=4, threshold=threshold, max_new_tokens=20,
                                                         stop_on_eos=False, seed=3))[0].tokens for p in prompts]
    if threshold == 0.0:
        assert differ  # the cache order changes what this model decodes


def test_first_hitting_past_the_model_length(fx):
    """Spans longer than L (the reference fails there): the first-hitting order goes on, equal to the
    recomputing reference with the oldest cache entries dropped."""
    from model.sampling import SamplingConfig, generate
    from model.sampling.reference import generate_reference
    from pretrain.checkpoint.inference import load_model

    model, tok, _ = load_model(fx["run"])
    cfg = SamplingConfig(window=4, threshold=0.3, max_new_tokens=L + 12, stop_on_eos=False, seed=1)
    p = tok.encode("Long text")
    out = generate(model, [p], cfg)[0]
    assert len(out.tokens) == L + 12 and out.tokens == generate_reference(model, [p], cfg)[0].tokens


def test_hf_export_decodes_in_the_recorded_order(fx, tmp_path):
    from transformers import AutoModelForMaskedLM

    from model.sampling import SamplingConfig, generate
    from pretrain.checkpoint.inference import load_model
    from pretrain.convert.export import export_checkpoint

    export_checkpoint(str(fx["run"]), tmp_path / "hf", log=lambda s: None)
    hf = AutoModelForMaskedLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    model, tok, _ = load_model(fx["run"])
    p = tok.encode("The answer is")
    for thr in (0.5, 0.0):
        torch.manual_seed(2)
        ours = generate(model, [p], SamplingConfig(window=4, threshold=thr, max_new_tokens=16, stop_on_eos=False))[0]
        torch.manual_seed(2)
        got = hf.set_diffusion_generate([p], max_new_tokens=16, window=4, threshold=thr, stop_on_eos=False)
        assert got.sequences[0] == ours.tokens
        pos = hf.set_diffusion_generate([p], max_new_tokens=16, window=4, threshold=thr, stop_on_eos=False,
                                        cache_order="position")
        want = generate(model, [p], SamplingConfig(window=4, threshold=thr, max_new_tokens=16, stop_on_eos=False,
                                                   cache_order="position"))[0].tokens
        assert pos.sequences[0] == want


def test_init_from_an_imported_release_keeps_rows_and_cache_order(fx, tmp_path):
    from helpers import write_recipe
    from pretrain import init_from
    from pretrain.config import load_config

    import yaml

    recipe = write_recipe(tmp_path / "ft.yaml", model={}, train={"init_from": str(fx["run"])})
    raw = yaml.safe_load(recipe.read_text())
    del raw["data"]["tokenizer"]  # left unset: init_from takes the imported run's own (a given one is kept)
    recipe.write_text(yaml.safe_dump(raw))
    arch = [f"run.out_dir={tmp_path / 'runs'}", "model.n_layers=2", "model.hidden=128", "model.n_heads=4",
            "model.ffn_hidden=256", "model.tie_embeddings=true", "data.seq_len=48"]
    cfg = load_config(recipe, [*arch, "model.max_seq_len=48"])
    src = init_from.prepare(cfg)
    assert src.kind == "checkpoint" and cfg.model.vocab_size == rf.ROWS and cfg.objective.cache_order == "first_hitting"
    # a recipe that leaves model.max_seq_len unset takes the release's own length, not the default 1024
    del raw["model"]["max_seq_len"]
    recipe.write_text(yaml.safe_dump(raw))
    cfg = load_config(recipe, arch)
    assert not cfg.given("model.max_seq_len") and cfg.model.max_seq_len == 1024
    src = init_from.prepare(cfg)
    assert cfg.model.max_seq_len == L and any(f"model.max_seq_len 1024 -> {L}" in n for n in src.notes), src.notes


# -- bad input: one line, exit 2 ------------------------------------------------------------------------


def _convert(*args, env=None):
    e = cli_env()
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "launch.cli", "convert", *map(str, args)], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=300)


def _one_line(r, *needles):
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    for n in needles:
        assert n in err[0], err[0]


class _Run:
    def __init__(self, returncode, stderr):
        self.returncode, self.stderr = returncode, stderr


def _convert_here(capsys, *args):
    """The command line in this process (the same one-line error wrapper as `setdlm convert`)."""
    from common.cli import run_command
    from pretrain.convert.cli import main

    capsys.readouterr()
    rc = run_command("setdlm convert", main, [str(a) for a in args])
    return _Run(rc, capsys.readouterr().err)


@pytest.mark.slow
def test_uncached_hub_base_and_pickle_payload_are_one_line(fx, tmp_path):
    """In a fresh process (the hub cache location is read at start-up): a base model named by a hub id that is
    not cached, and a pickle payload in pytorch_model.bin, which is refused before it runs."""
    import shutil

    src = fx["setdlm"]
    hub = {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    _one_line(_convert("from-reference", "--model", src, "--out", tmp_path / "o1", env=hub), "--base-model",
              rf.HUB_BASE, "cache")
    d = tmp_path / "payload"
    shutil.copytree(src, d)
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"backbone.model.model.embed_tokens.weight": Payload()}, d / "pytorch_model.bin")
    _one_line(_convert("from-reference", "--model", d, "--out", tmp_path / "o2", "--base-model", fx["base"]),
              "pytorch_model.bin", "refused")
    assert not marker.exists() and not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_bad_releases_are_one_line(fx, tmp_path, capsys):
    import shutil

    src = fx["setdlm"]
    _one_line(_convert_here(capsys, "from-reference", "--model", src, "--out", tmp_path / "o1", "--base-model",
                            tmp_path / "nowhere"), "--base-model", "no such directory")
    # no config.json
    d = tmp_path / "noconfig"
    shutil.copytree(src, d)
    (d / "config.json").unlink()
    _one_line(_convert_here(capsys, "from-reference", "--model", d, "--out", tmp_path / "o2"), "config.json")
    _one_line(_convert_here(capsys, "from-reference", "--model", d, "--out", tmp_path / "o2", "--base-model",
                            fx["base"]), "--base-model", "no config.json", "copy it in")
    assert "DiT checkpoint;" not in capsys.readouterr().err
    # no weights
    d = tmp_path / "noweights"
    shutil.copytree(src, d)
    (d / "pytorch_model.bin").unlink()
    _one_line(_convert_here(capsys, "from-reference", "--model", d, "--out", tmp_path / "o3", "--base-model",
                            fx["base"]), "no weights")
    # tied/untied mismatch both ways
    _one_line(_convert_here(capsys, "from-reference", "--model", src, "--out", tmp_path / "o4", "--base-model",
                            fx["base_untied"]), "tied/untied")
    d = rf.write_release(tmp_path / "untied", fx["bb_untied"], rf.release_config("setdlm", L))
    _one_line(_convert_here(capsys, "from-reference", "--model", d, "--out", tmp_path / "o5", "--base-model",
                            fx["base"]), "tied/untied")
    # a base model that is not the one trained from (another layer count)
    d = rf.write_release(tmp_path / "short", fx["bb"], rf.release_config("setdlm", L), layers=[0])
    _one_line(_convert_here(capsys, "from-reference", "--model", d, "--out", tmp_path / "o6", "--base-model",
                            fx["base"]), "1 layers", "num_layers=-1")
    # from-hf on a release names the command that works
    _one_line(_convert_here(capsys, "from-hf", "--model", src, "--out", tmp_path / "o7"),
              "setdlm convert from-reference")
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 8))


def test_init_from_a_release_directory_names_the_import(fx, tmp_path):
    from common.schema import ConfigError
    from helpers import write_recipe
    from pretrain import init_from
    from pretrain.config import load_config

    recipe = write_recipe(tmp_path / "ft.yaml", train={"init_from": str(fx["setdlm"])})
    cfg = load_config(recipe, [f"run.out_dir={tmp_path / 'runs'}"])
    with pytest.raises(ConfigError, match="setdlm convert from-reference"):
        init_from.prepare(cfg)


def test_reinit_release_takes_its_shape_overrides(fx, tmp_path):
    """The CNN/DM releases: reinit_model with backbone_config hidden_size / intermediate_size and num_layers
    overriding the base model's config (AutoConfig.from_pretrained(name, **overrides))."""
    from transformers import Qwen3ForCausalLM

    from pretrain.convert.from_reference import import_reference

    conf = {**fx["bb"].config.to_dict(), "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1}
    conf["layer_types"] = ["full_attention"]
    torch.manual_seed(4)
    small = Qwen3ForCausalLM(fx["bb"].config.__class__(**conf)).eval()
    cfg = rf.release_config("setdlm", L, num_layers=1)
    cfg["backbone_config"].update(reinit_model=True, hidden_size=64, intermediate_size=96)
    d = rf.write_release(tmp_path / "cnndm-setdlm-smax8", small, cfg)
    run = import_reference(d, tmp_path / "run", base_model=str(fx["base"]), log=lambda s: None)
    ids, pos = rf.two_stream_inputs(L, 50257, seed=6)
    ours, mask, (_, _, rcfg) = _ours(run, ids, pos, "set_causal")
    _close(ours, rf.transformers_logits(small, ids, pos, mask), 50257)
    assert (rcfg.model.hidden, rcfg.model.ffn_hidden, rcfg.model.n_layers) == (64, 96, 1)


def test_paper_matrix_imports_releases_and_summarises(fx, tmp_path, capsys):
    """A paper matrix over a released checkpoint: a cell refuses to run before `--import`, `--import`
    imports it once, and `--summary` puts each row's number beside the paper's."""
    import json

    from common.cli import run_command
    from eval.matrix import load_matrix
    from eval.matrix import main as matrix_main

    m = tmp_path / "m.yaml"
    m.write_text(f"""
out: {tmp_path / 'results'}
imports: {tmp_path / 'released'}
checkpoints:
  rel: {{release: {fx['setdlm']}, base_model: {fx['base']}}}
rows:
  - {{table: T1, checkpoint: rel, task: likelihood, setting: a, args: --max-batches 1,
     paper: {{metric: ppl, value: 12.5, source: "Table 1"}}}}
  - {{table: T1, checkpoint: rel, task: likelihood, setting: b, paper: {{metric: ppl, value: null, source: "n/a"}}}}
""")

    def run(*a):
        capsys.readouterr()
        rc = run_command("setdlm eval matrix", matrix_main, [str(m), *a])
        return rc, capsys.readouterr()

    rc, out = run("--index", "0")
    assert rc == 2 and "--import" in out.err and len(out.err.strip().splitlines()) == 1
    assert run("--import")[0] == 0 and (tmp_path / "released" / "rel" / "checkpoints").is_dir()
    assert "already imported" in run("--import")[1].out
    cell = load_matrix(str(m))[0]
    Path(cell["out"]).mkdir(parents=True)
    (Path(cell["out"]) / "metrics.json").write_text(json.dumps({"metrics": {"ppl": 13.25}}))
    rc, out = run("--summary")
    text = (tmp_path / "results" / "summary.md").read_text()
    assert rc == 0 and "| T1 | rel | likelihood | a | ppl | 12.5 | 13.25 | Table 1 |" in text
    assert "| T1 | rel | likelihood | b | ppl | - | not run | n/a |" in text


def test_hub_ids_resolve_through_the_local_cache(fx, tmp_path, monkeypatch):
    """The base model named by a hub id (no --base-model), and the release itself as --model HUB_ID, read from
    the local Hugging Face cache (nothing downloaded); D from the hub id's name when noise_config lacks it."""
    import json
    import shutil

    import huggingface_hub.constants as hub_constants

    from pretrain.checkpoint.inference import load_model
    from pretrain.convert.from_reference import import_reference

    cache = tmp_path / "hub"

    def cached(repo: str, src: Path, files) -> None:
        d = cache / ("models--" + repo.replace("/", "--"))
        snap = d / "snapshots" / ("0" * 40)
        snap.mkdir(parents=True)
        (d / "refs").mkdir()
        (d / "refs" / "main").write_text("0" * 40)
        for f in files:
            shutil.copy(src / f, snap / f)

    cached(rf.HUB_BASE, fx["base"], ["config.json"])
    cfg = rf.release_config("setdlm", L)
    del cfg["noise_config"]["desired_block_size"]
    rel = rf.write_release(tmp_path / "src", fx["bb"], cfg)
    cached("org/setdlm-gsm8k-smax16", rel, [p.name for p in rel.iterdir() if p.is_file()])
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    run = import_reference("org/setdlm-gsm8k-smax16", tmp_path / "run", log=lambda s: None)
    _, _, rcfg = load_model(run)
    assert rcfg.objective.set_size == 8  # smax16: D = 8, as the reference's loader reads the name
    assert json.loads((run / "checkpoints" / "step_00000000" / "meta.json").read_text())["imported"]["base_model"] \
        == rf.HUB_BASE
