"""Evaluation runs on a tiny model trained in-process: exact likelihood, rank splits, resume, every task,
bad input, merge, matrix and the Slurm template. Fixtures in tests/fixtures/eval were written for this
project in the real schemas; nothing reaches the hub."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, cli_env, read_metrics, write_recipe

from eval.cli import main as eval_main
from eval.cli import run_task
from model import families

FIX = REPO / "tests" / "fixtures" / "eval"
MAX_BATCHES = 2  # = the recipe's train.eval_batches below


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model_parallel):
    """A tiny SW-SetDLM trained for 8 steps (validated at the end, 2 batches)."""
    import torch

    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("evalrun")
    recipe = write_recipe(tmp / "r.yaml", train={"max_steps": 8, "eval_every": 8, "save_every": 8,
                                                 "eval_batches": MAX_BATCHES, "log_every": 8})
    Trainer(load_config(recipe, [f"run.out_dir={tmp}"])).train()
    return tmp / "tiny"


def _records(out):
    rows = [json.loads(line) for line in (Path(out) / "examples.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("unit", None)
    return rows


def _metrics(out):
    return json.loads((Path(out) / "metrics.json").read_text())["metrics"]


@pytest.fixture(scope="module")
def lik_one_rank(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lik1")
    res = run_task("likelihood", ["--checkpoint", str(run_dir), "--out", str(out), "--match-training"])
    assert res["merged"]
    return out


# ------------------------------------------------------------------------------------------ likelihood
def test_likelihood_matches_training_validation_exactly(run_dir, lik_one_rank):
    val = read_metrics(run_dir)[8]
    m = _metrics(lik_one_rank)
    assert m["nll"] == val["val/nll"]  # same data, seed, batches, EMA/precision rule: bit-identical
    spec = json.loads((lik_one_rank / "metrics.json").read_text())["spec"]
    assert (spec["max_batches"], spec["batch_size"], spec["dp"]) == (MAX_BATCHES, 4, 1)
    assert m["tokens"] == val["val/tokens"] and m["bpt"] == val["val/bpt"]
    assert m["objective"] == "setdlm" and m["sequences"] == 4 * MAX_BATCHES
    summary = (lik_one_rank / "summary.md").read_text()
    assert "| nll |" in summary and "step 8" in summary


# The default family is checked by the tests above (run_dir); one other family with EMA weights.
@pytest.mark.parametrize("objective", [n for n in families.names() if n != families.DEFAULT.name])
def test_likelihood_matches_training_validation_for_every_objective(tmp_path, model_parallel, objective):
    extra = ["train.ema=0.9"] if objective == families.MDLM.name else []
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    recipe = write_recipe(tmp_path / "r.yaml", train={"max_steps": 2, "eval_every": 2, "save_every": 2,
                                                      "eval_batches": 1, "log_every": 2})
    Trainer(load_config(recipe, [f"run.out_dir={tmp_path}", f"objective.name={objective}", *extra])).train()
    out = tmp_path / "lik"
    m = run_task("likelihood", ["--checkpoint", str(tmp_path / "tiny"), "--out", str(out), "--max-batches", "1"])["metrics"]
    assert m["nll"] == read_metrics(tmp_path / "tiny")[2]["val/nll"]
    assert m["bound"] == families.get(objective).bound
    assert m["tokens"] == 4 * families.get(objective).layout(32).tokens_out


def test_likelihood_split_over_two_ranks_equals_one_rank(run_dir, lik_one_rank, tmp_path):
    for i in (0, 1):  # two independent shards (as a Slurm array); the second to finish merges
        res = run_task("likelihood", ["--checkpoint", str(run_dir), "--out", str(tmp_path), "--max-batches",
                                      str(MAX_BATCHES), "--shard", f"{i}/2"])
        assert res["stats"]["ran"] == 1
    assert res["merged"]
    assert _records(tmp_path) == _records(lik_one_rank)
    assert _metrics(tmp_path) == _metrics(lik_one_rank)


class Killed(Exception):
    pass


def test_killed_likelihood_restarts_without_redoing_finished_batches(run_dir, lik_one_rank, tmp_path):
    def die_after_first(unit, recs):
        raise Killed()

    args = ["--checkpoint", str(run_dir), "--out", str(tmp_path), "--max-batches", str(MAX_BATCHES)]
    with pytest.raises(Killed):
        run_task("likelihood", args, after_unit=die_after_first)
    assert (tmp_path / "failed.rank00000.json").is_file() and not (tmp_path / "metrics.json").exists()
    with open(tmp_path / "records.rank00000.jsonl", "a") as f:
        f.write('{"key": "0/1/0", "tok')  # and a line torn by the kill
    res = run_task("likelihood", args)
    assert res["stats"] == {"units": 2, "ran": 1, "skipped": 1}
    assert _metrics(tmp_path) == _metrics(lik_one_rank)
    assert _records(tmp_path) == _records(lik_one_rank)
    assert not (tmp_path / "failed.rank00000.json").exists()


def test_likelihood_several_orders_and_held_out_text(run_dir, lik_one_rank, tmp_path):
    run_task("likelihood", ["--checkpoint", str(run_dir), "--out", str(tmp_path / "k2"), "--max-batches",
                            str(MAX_BATCHES), "--orders", "2"])
    m, m1 = _metrics(tmp_path / "k2"), _metrics(lik_one_rank)
    assert m["nll_per_order"][0] == pytest.approx(m1["nll"], rel=1e-12)  # order 0 is the training stream
    assert m["nll_iw"] <= m["nll"] + 1e-9  # -log mean_k p(x|order_k) <= mean_k -log p(x|order_k)
    text = tmp_path / "heldout.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n\nA second document about lists and loops.\n")
    run_task("likelihood", ["--checkpoint", str(run_dir), "--out", str(tmp_path / "txt"), "--text", str(text)])
    mt = _metrics(tmp_path / "txt")
    assert mt["tokens"] > 10 and mt["sequences"] == 1 and mt["nll"] > 0


# ------------------------------------------------------------------------------------------ gsm8k
class Oracle:
    """Returns the gold solution (or another problem's) as the generation."""

    name = "oracle"

    def __init__(self, shift=0):
        self.shift = shift
        self.golds = [json.loads(line)["answer"] for line in (FIX / "gsm8k_test.jsonl").read_text().splitlines()]

    def complete(self, prompts, seed, examples=None, **kw):
        out = []
        for ex in examples:
            i = self.golds.index(ex["answer"])
            out.append({"text": " " + self.golds[(i + self.shift) % len(self.golds)], "tokens": [], "n_tokens": 0,
                        "steps": 0, "seconds": 0.0, "tokens_per_step": 0.0, "stop_reason": "length"})
        return out


@pytest.mark.parametrize("backend", ["direct", "lm-eval"])
def test_gsm8k_gold_generations_score_100_and_shuffled_0(tmp_path, backend):
    if backend == "lm-eval":
        pytest.importorskip("lm_eval")
    base = ["--data", str(FIX / "gsm8k_test.jsonl"), "--backend", backend, "--batch-size", "3"]
    gold = run_task("gsm8k", base + ["--out", str(tmp_path / "gold")], predictor=Oracle())["metrics"]
    wrong = run_task("gsm8k", base + ["--out", str(tmp_path / "shuf")], predictor=Oracle(shift=5))["metrics"]
    assert gold["accuracy"] == 1.0 and gold["n"] == 12 and gold["extraction"] == {"####": 12}
    assert wrong["accuracy"] == 0.0
    if backend == "lm-eval":  # the harness scored the replayed generations the same way
        assert gold["lm_eval/exact_match"] == 1.0 and wrong["lm_eval/exact_match"] == 0.0
        recs = _records(tmp_path / "gold")
        assert recs[0]["prompt"].startswith("Question: Mara packs") and recs[0]["prompt"].endswith("\nAnswer:")


def test_gsm8k_generation_is_rank_independent_and_resumes(run_dir, tmp_path):
    base = ["--checkpoint", str(run_dir), "--data", str(FIX / "gsm8k_test.jsonl"), "--limit", "4",
            "--max-new-tokens", "4", "--backend", "direct", "--fewshot", "1",
            "--fewshot-data", str(FIX / "gsm8k_train.jsonl"), "--temperature", "1.0", "--overlong", "truncate"]
    one = run_task("gsm8k", base + ["--out", str(tmp_path / "one")])
    for i in (0, 1):
        run_task("gsm8k", base + ["--out", str(tmp_path / "two"), "--shard", f"{i}/2"])

    def strip(rows):
        return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]

    assert strip(_records(tmp_path / "two")) == strip(_records(tmp_path / "one"))
    assert _metrics(tmp_path / "two")["accuracy"] == one["metrics"]["accuracy"]

    calls = []

    def die_after_two(unit, recs):
        calls.append(unit.index)
        if len(calls) == 2:
            raise Killed()

    with pytest.raises(Killed):
        run_task("gsm8k", base + ["--out", str(tmp_path / "re")], after_unit=die_after_two)
    again = run_task("gsm8k", base + ["--out", str(tmp_path / "re")])
    assert again["stats"]["ran"] == 2 and again["stats"]["skipped"] == 2
    assert strip(_records(tmp_path / "re")) == strip(_records(tmp_path / "one"))
    r = _records(tmp_path / "one")[0]
    assert r["prompt"].count("Question:") == 2 and r["n_tokens"] <= 4


# ------------------------------------------------------------------------------------------ other tasks
def test_infill_summarize_uncond_throughput_run_end_to_end(run_dir, tmp_path):
    ck = ["--checkpoint", str(run_dir)]
    m = run_task("infill", ck + ["--out", str(tmp_path / "inf"), "--data", str(FIX / "rocstories_cloze.csv"),
                                 "--limit", "2", "--span", "2-4"])["metrics"]
    rec = _records(tmp_path / "inf")[0]
    assert rec["reference"] == ("She bought flour and yeast at the market. Her first loaf came out flat and dense. "
                                "She tried again and let the dough rise longer.")
    assert rec["n_tokens"] == rec["span_tokens"] > 10 and 0.0 <= m["rouge1"] <= 1.0

    m = run_task("summarize", ck + ["--out", str(tmp_path / "sum"), "--data", str(FIX / "cnndm.csv"), "--limit", "2",
                                    "--max-new-tokens", "12", "--overlong", "truncate"])["metrics"]
    assert m["n"] == 2 and m["articles_cut"] >= 1  # 64-token context: long articles are cut to fit
    rec = _records(tmp_path / "sum")[0]
    assert rec["article_cut"] and rec["prompt_tokens"] + 12 <= 64 and rec["prompt_cut"] == 0

    m = run_task("uncond", ck + ["--out", str(tmp_path / "unc"), "--num-samples", "4", "--length", "8",
                                 "--batch-size", "2", "--featurizer", "self", "--scorer", str(run_dir)])["metrics"]
    assert m["mauve"] is None and "too few" in m["mauve_warning"]  # 4 samples: MAUVE is not reported
    assert 0.0 <= m["mauve_small_sample"] <= 1.0 + 1e-9 and m["gen_ppl"] > 1 and m["ref_gen_ppl"] > 1 and m["n"] == 4
    assert m["sample_tokens"] == 8 and "final hidden states" in m["featurizer"]

    m = run_task("throughput", ck + ["--out", str(tmp_path / "thr"), "--num-examples", "2", "--max-new-tokens", "4",
                                     "--warmup", "1", "--batch-sizes", "1,2", "--sweep", "threshold=0.5",
                                     "--sweep", "adaptive_window=true"])["metrics"]
    rows = {(r["setting"], r["batch_size"]): r for r in m["rows"]}
    assert set(rows) == {(s, b) for s in ("base", "threshold=0.5", "adaptive_window=True") for b in (1, 2)}
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_step"] >= 1 for r in rows.values())
    assert (tmp_path / "thr" / "frontier.png").stat().st_size > 1000
    assert "frontier.png" in (tmp_path / "thr" / "summary.md").read_text()


# ------------------------------------------------------------------------------------------ bad input
def test_bad_input_gives_clear_errors(run_dir, tmp_path, capsys):
    def err(*argv):
        assert eval_main(list(map(str, argv))) == 2
        return capsys.readouterr().err

    e = err("likelihood", "--checkpoint", tmp_path / "nope", "--out", tmp_path / "o1")
    assert "--checkpoint" in e and "no such file" in e
    e = err("infill", "--checkpoint", run_dir, "--out", tmp_path / "o2", "--data", FIX / "rocstories_badcols.csv")
    assert "missing columns" in e and "InputStoryid" in e
    e = err("gsm8k", "--checkpoint", run_dir, "--out", tmp_path / "o3", "--data", FIX / "gsm8k_test.jsonl",
            "--fewshot", "2")
    assert "--fewshot-data" in e
    e = err("throughput", "--checkpoint", run_dir, "--out", tmp_path / "o4", "--sweep", "thresold=0.5")
    assert "'thresold' is not a sampling option" in e

    # tokenizer mismatch: shards prepared with bert-base-uncased, checkpoint trained with gpt2
    from data_pipeline.prepare import prepare

    txt = tmp_path / "docs.txt"
    txt.write_text("\n".join(f"document {i} has a few words about cats and dogs and birds" * 3 for i in range(12)))
    prepare(str(txt), str(tmp_path / "bert"), tokenizer="bert-base-uncased", seq_len=32, val_docs=4, num_proc=1,
            log=lambda m: None)
    e = err("likelihood", "--checkpoint", run_dir, "--out", tmp_path / "o5", "--data", tmp_path / "bert")
    assert "tokenizer mismatch" in e and "'bert-base-uncased'" in e and "'gpt2'" in e

    # an output directory that holds another evaluation is not mixed with this one
    base = ["--checkpoint", run_dir, "--out", tmp_path / "o6", "--max-batches", "1"]
    assert eval_main(list(map(str, ["likelihood", *base]))) == 0
    e = err("likelihood", *base[:-1], "2")
    assert "different evaluation" in e and "max_batches" in e


def test_merge_of_an_incomplete_run(run_dir, tmp_path, capsys):
    run_task("likelihood", ["--checkpoint", str(run_dir), "--out", str(tmp_path), "--max-batches", "2", "--shard", "0/2"])
    assert not (tmp_path / "metrics.json").exists()
    assert eval_main(["merge", str(tmp_path)]) == 3
    assert "4 of 8 examples have no records yet" in capsys.readouterr().err
    assert eval_main(["merge", str(tmp_path), "--allow-partial"]) == 0
    m = _metrics(tmp_path)
    assert m["partial"] and m["missing_examples"] == 4 and m["sequences"] == 4


# ------------------------------------------------------------------------------------------ cluster
def test_matrix_cells_and_slurm_template(tmp_path, capsys):
    from eval.matrix import load_matrix

    mfile = tmp_path / "m.yaml"
    mfile.write_text(f"""
out: {tmp_path}/res
checkpoints: {{a: runs/a, b: runs/b}}
tasks:
  likelihood: {{}}
  gsm8k:
    args: [--data, g.jsonl]
    settings: {{t09: --threshold 0.9, t10: [--threshold, "1.0"]}}
""")
    cells = load_matrix(str(mfile))
    assert len(cells) == 6
    assert cells[2]["out"] == f"{tmp_path}/res/a/gsm8k/t10"
    assert cells[2]["args"] == ["--data", "g.jsonl", "--threshold", "1.0"]
    assert eval_main(["matrix", str(mfile), "--count"]) == 0 and capsys.readouterr().out.strip() == "6"

    # the sbatch script, run as array task 4 without Slurm (SRUN="" runs the step in the shell)
    env = cli_env()
    env.update(MATRIX=str(mfile), SLURM_ARRAY_TASK_ID="4", SRUN="", MATRIX_ARGS="--dry-run",
               EVAL_CMD=f"{sys.executable} -m launch.cli eval")
    p = subprocess.run(["bash", str(REPO / "eval" / "templates" / "eval_matrix.sbatch")], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert f"setdlm eval gsm8k --checkpoint runs/b --out {tmp_path}/res/b/gsm8k/t09 --data g.jsonl --threshold 0.9" in p.stdout


@pytest.mark.slow
def test_two_processes_under_a_launcher_merge_on_rank_zero(run_dir, lik_one_rank, tmp_path):
    out = tmp_path / "launched"
    p = subprocess.run([sys.executable, "-m", "launch.cli", "launch", "local", "-n", "2", "--", "-m", "launch.cli",
                        "eval", "likelihood", "--checkpoint", str(run_dir), "--out", str(out),
                        "--max-batches", str(MAX_BATCHES)], env=cli_env(), cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(x.name for x in out.glob("records.rank*.jsonl")) == ["records.rank00000.jsonl", "records.rank00001.jsonl"]
    assert _metrics(out) == _metrics(lik_one_rank)
    assert json.loads((out / "metrics.json").read_text())["created"]["world"] == 2
