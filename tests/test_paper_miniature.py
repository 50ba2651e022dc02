"""The paper in miniature (benchmarks/paper_miniature.py): its task and tokenizer, the naive masked-only
estimator against a recomputation, the gradient variance, the verdicts, the timed pass, and (slow) the
whole pipeline's pieces at a tiny size writing every claim id."""

import json
import math
import random
import subprocess
import sys

import pytest
import torch

from helpers import REPO, cli_env

sys.path.insert(0, str(REPO))  # benchmarks/ is not an installed package
from benchmarks import miniature_claims as mc  # noqa: E402
from benchmarks import miniature_measure as mm  # noqa: E402
from benchmarks import miniature_task as task  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from data_pipeline.tokenizers import load_tokenizer

    return load_tokenizer(task.build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer"))


def test_tokenizer_is_a_directory_the_stack_loads_and_round_trips_every_problem(tokenizer):
    assert tokenizer.vocab_size == len(task.vocabulary()) < 100
    assert tokenizer.id_to_token(tokenizer.mask_id) == task.MASK and tokenizer.eos_id is not None
    assert tokenizer.pad_id not in (tokenizer.eos_id, tokenizer.mask_id)
    unk = tokenizer.token_to_id(task.UNK)
    rng = random.Random(0)
    for _ in range(300):
        p = task.problem(rng)
        text = f"Question: {p['question']}\nAnswer: {p['answer']}"
        ids = tokenizer.encode(text)
        assert unk not in ids and tokenizer.decode(ids) == text
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode(" 47+38")] == [" 4", "7", "+", "3", "8"]
    assert unk in tokenizer.encode("a stranger word%")  # what the task never writes is unknown, not mangled


def test_problems_are_correct_seeded_and_scored_as_gsm8k(tmp_path):
    from eval.metrics import extract_answer, gold_answer

    rng, ops = random.Random(1), {"++": 0, "+-": 0, "-+": 0, "--": 0}
    for _ in range(500):
        p = task.problem(rng)
        lines = p["answer"].split("\n")
        assert len(lines) == 3 and all(10 <= n <= 99 for s in p["steps"] for n in (s[0], s[2], s[3]))
        for line, (x, op, y, r) in zip(lines, p["steps"]):
            assert line == f"{x}{op}{y}={r}." and r == (x + y if op == "+" else x - y)
        assert gold_answer(p["answer"]) == str(p["steps"][-1][3]) == extract_answer(" " + p["answer"])[0]
        ops[p["steps"][0][1] + p["steps"][1][1]] += 1
    assert min(ops.values()) > 100  # the operations are drawn uniformly, before the operands
    a = task.make_splits(tmp_path / "a", seed=3, train=200, test=50)
    b = task.make_splits(tmp_path / "b", seed=3, train=200, test=50)
    assert open(a["train"]).read() == open(b["train"]).read() and open(a["test"]).read() == open(b["test"]).read()
    train = {json.loads(line)["question"] for line in open(a["train"])}
    test = [json.loads(line)["question"] for line in open(a["test"])]
    assert len(train) == 200 and len(set(test)) == 50 and not train & set(test)


def test_infill_example_masks_the_second_step_between_both_sides(tokenizer):
    row = {"question": "Ann has 47 apples. Ann buys 38 and then loses 19. How many apples does Ann have?",
           "answer": "47+38=85.\n85-19=66.\n#### 66"}
    e = task.infill_example(row, tokenizer)
    assert e["span_text"] == "85-19=66."
    assert tokenizer.decode(e["prefix"] + e["span"] + e["suffix"][:-1]) == (
        f"Question: {row['question']}\nAnswer: {row['answer']}")
    assert e["suffix"][-1] == tokenizer.eos_id and tokenizer.decode(e["suffix"][:-1]) == "\n#### 66"


# -- the gradient-variance estimators -------------------------------------------------------------------
@pytest.fixture(scope="module")
def setdlm(one_thread):
    from model.config import ObjectiveConfig
    from model.objectives import build_objective
    from model.sampling.testing import tiny_model

    model = tiny_model(seed=0, init_std=0.3)
    return model, build_objective(ObjectiveConfig(name="setdlm", set_size=4), model.cfg, 16)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 48, (6, 16), generator=g)
    context = torch.zeros(6, 16, dtype=torch.bool)
    context[:, :3] = True
    valid = torch.ones(6, 16, dtype=torch.bool)
    valid[1, 12:] = False
    valid[4, 9:] = False
    return {"input_ids": x, "context_mask": context, "valid_mask": valid}


def test_naive_inputs_predict_the_masked_set_from_the_revealed_one(setdlm):
    model, obj = setdlm
    b = _batch()
    inp = mm.naive_inputs(obj, b, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)  # the same draws: masking times, then one time per row
    T = obj.schedule.masking_times(6, g)
    t = torch.rand((6, 1), generator=g, dtype=torch.float64)
    masked = b["valid_mask"] & ~b["context_mask"] & (T < t)
    perm, r0, L = inp.extra["perm"], inp.extra["r0"], 16
    for row in range(6):
        ranks_masked = {int(r) for r in range(L) if masked[row, perm[row, r]]}
        assert ranks_masked == set(range(int(r0[row]), int(r0[row]) + len(ranks_masked)))  # a suffix of the valid ranks
        assert all(b["context_mask"][row, perm[row, r]] for r in range(3))  # the prompt is revealed first
        assert inp.loss_weight[row].nonzero().flatten().tolist() == sorted(ranks_masked)
    assert masked.any() and (~masked & b["valid_mask"] & ~b["context_mask"]).any()  # both kinds occur
    with torch.no_grad():
        logits = model(inp.input_ids, inp.position_ids, inp.attn_mask, logits_slice=inp.logits_slice)
        for row in range(6):  # reference: each masked query alone after the revealed tokens in order
            n = int(r0[row])
            for r in inp.loss_weight[row].nonzero().flatten().tolist():
                ids = torch.cat((inp.input_ids[row, :n], torch.tensor([obj.mask_id])))[None]
                pos = torch.cat((perm[row, :n], perm[row, r:r + 1]))[None]
                ref = model(ids, pos, torch.ones(n + 1, n + 1, dtype=torch.bool).tril())[0, -1]
                torch.testing.assert_close(logits[row, r], ref, atol=1e-4, rtol=1e-4)
    te = obj.prepare(b, torch.Generator().manual_seed(7))
    assert int(te.loss_weight.sum()) == int((b["valid_mask"] & ~b["context_mask"]).sum()) > int(inp.loss_weight.sum())


def test_total_variance_is_the_reference_definition(setdlm):
    g = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 2.0]), torch.tensor([2.0, 5.0])]
    mean = torch.stack(g).mean(0)
    assert mm.total_variance(g) == pytest.approx(sum(float((v - mean).pow(2).sum()) for v in g) / 2)
    model, obj = setdlm
    b = _batch(1)
    v = mm.grad_vector(model, obj, obj.prepare(b, torch.Generator().manual_seed(0)))
    n = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)
    assert v.shape == (n,) and torch.isfinite(v).all() and float(v.norm()) > 0


# -- verdicts ---------------------------------------------------------------------------------------------
def test_verdicts_are_held_contradicted_or_not_resolved_at_two_standard_errors():
    a, b = mc.seed_summary([0.6, 0.62, 0.64]), mc.seed_summary([0.5, 0.52, 0.54])
    assert a["se"] == pytest.approx(0.02 / math.sqrt(3))
    assert mc.compare(a, b, "x")["verdict"] == "held" and mc.compare(b, a, "x")["verdict"] == "contradicted"
    c = mc.seed_summary([0.4, 0.6, 0.8])
    assert mc.compare(c, b, "x")["verdict"] == "not resolved"
    assert mc.combine(["held", "held"]) == "held" and mc.combine(["held", "not resolved"]) == "not resolved"
    assert mc.combine(["held", "contradicted"]) == "contradicted"


def test_frontier_compares_best_accuracy_at_least_as_parallel_on_the_shared_grid():
    assert mc.envelope([(1.0, 0.5), (2.0, 0.3), (3.1, 0.1)], 1.5) == 0.3 and mc.envelope([(1.0, 0.5)], 2.0) is None
    hi = {s: [(1.0, 0.60 + d), (2.0, 0.50 + d), (4.0, 0.2)] for s, d in ((1, 0.0), (2, 0.01), (3, 0.02))}
    lo = {s: [(1.0, 0.50 + d), (1.6, 0.30 + d)] for s, d in ((1, 0.0), (2, 0.01), (3, 0.02))}
    got = mc.frontier_claim({"setdlm": hi, "bd3lm": lo}, "setdlm", "bd3lm")
    assert got["grid_used"] == [0.9, 1.25, 1.5] and got["verdict"] == "held"  # 2.0+ is beyond bd3lm's reach
    assert got["scores"]["setdlm"]["mean"] == pytest.approx((0.61 + 0.51 + 0.51) / 3)
    assert mc.frontier_claim({"setdlm": lo, "bd3lm": hi}, "setdlm", "bd3lm")["verdict"] == "contradicted"
    assert mc.frontier_claim({"setdlm": hi, "bd3lm": hi}, "setdlm", "bd3lm")["verdict"] == "not resolved"
    far = {1: [(5.0, 0.1)]}
    assert mc.frontier_claim({"setdlm": far, "bd3lm": {1: [(0.5, 0.1)]}}, "setdlm", "bd3lm")["grid_used"] == []


def test_likelihood_and_variance_claims():
    bounds = {"AR": [(1.0, 0.0), (1.01, 0.0)], "S": [(1.2, 0.001), (1.21, 0.001)], "B": [(1.5, 0.01), (1.52, 0.01)],
              "M": [(1.3, 0.01), (1.31, 0.01)]}
    got = mc.likelihood_claim(bounds, ["AR", "S", "B", "M"])
    assert [o["verdict"] for o in got["orderings"]] == ["held", "held", "reversed"] and got["verdict"] == "contradicted"
    assert mc.likelihood_claim(bounds, ["AR", "S", "M"])["verdict"] == "held"
    per = [{"draws": 33, "fresh": {"naive": {"variance": 3.0 * f}, "token_efficient": {"variance": 1.0}}}
           for f in (0.9, 1.0, 1.1)]
    v = mc.variance_claim(per)
    assert v["ratio"] == pytest.approx(3.0 * math.exp(sum(math.log(f) for f in (0.9, 1.0, 1.1)) / 3))
    assert v["verdict"] == "held" and v["ratio_2se"][0] < v["ratio"] < v["ratio_2se"][1]


# -- the timed pass ----------------------------------------------------------------------------------------
def test_timed_pass_warms_up_then_reports_the_median_pass(setdlm):
    from model.sampling import SamplingConfig
    from model.sampling.testing import CharTokenizer

    model, _ = setdlm
    cfg = SamplingConfig(family="setdlm", window=4, threshold=0.5, max_new_tokens=8, s_max=8)
    got = mm.timed(model, CharTokenizer(), [[1, 2, 3], [4, 5]], cfg, warmup=1, repeats=3)
    assert len(got["passes"]) == 3 and got["tokens_per_s"] == sorted(got["passes"])[1]
    assert got["tokens_per_forward"] >= 1.0 and len(got["load_before"]) == 3 and got["prompts"] == 2


@pytest.mark.slow
def test_bad_command_lines_are_one_line_errors(tmp_path):
    script = str(REPO / "benchmarks" / "paper_miniature.py")
    for argv, word in ((["--jobs", "0"], "--jobs"), (["--timed-only", "--out", str(tmp_path)], "--timed-only")):
        r = subprocess.run([sys.executable, script, *argv], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and word in r.stderr and "Traceback" not in r.stderr


# -- the pipeline's pieces --------------------------------------------------------------------------------
@pytest.mark.slow
def test_pipeline_pieces_write_every_claim_id(tmp_path, model_parallel, one_thread):
    """prepare -> train and measure each model (in this process) -> timed pass -> report, at a tiny size."""
    from benchmarks import paper_miniature as pm
    from benchmarks.miniature_report import write_report

    size = dict(pm.SIZES["smoke"], steps=2, train_rows=120, val_rows=32, test_rows=4, grad_draws=2,
                timed_prompts=1, timed_warmup=1, timed_repeats=1)
    out = tmp_path / "mini"
    spec = pm.prepare(out, size)
    assert spec["prepare"].startswith("setdlm data prepare --format prompt_answer --template plain")
    for slug in size["models"]:
        for seed in pm.seeds(size):
            pm.work(slug, seed, size, out)
            assert pm.missing(slug, seed, size, out) == []
    pm.timed_pass(size, out, redo=False)
    path = write_report(out, out, size, smoke=True, phases=[{"started": "now", "load_start": [1, 1, 1],
                                                             "load_end": [1, 1, 1], "seconds": 1.0}])
    data = json.loads(path.read_text())
    assert [c["id"] for c in data["claims"]] == ["frontier", "infill", "cache_ablation", "gradient_variance",
                                               "likelihood_order"]
    assert all(c["verdict"] in mc.VERDICTS for c in data["claims"])
    assert set(data["reasoning"]["accuracy"]) == {pm.AR, pm.SW, pm.BD3, pm.MD}
    assert all(0.0 <= a <= 1.0 for a in data["reasoning"]["accuracy"].values())
    assert len(data["commit"]) == 40
    rows = {(r["model"], r["setting"]): r for r in data["settings"]}
    assert rows["mdlm", "8 steps"]["tokens_per_s"]["seeds"] == 2 and rows["ar", "greedy"]["accuracy"]["seeds"] == 2
    text = (out / "paper_miniature.md").read_text()
    assert "![frontier](paper_miniature.png)" in text and "| claim | paper | result here | verdict |" in text
    assert (out / "paper_miniature.png").stat().st_size > 1000
