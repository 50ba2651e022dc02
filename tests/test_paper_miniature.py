"""The paper in miniature (benchmarks/paper_miniature.py): its task and tokenizer, the naive masked-only
estimator against a recomputation, the gradient variance, the verdicts, the timed pass, and (slow) the
whole pipeline's pieces at a tiny size writing every claim id."""

import json
import math
import random
import re
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


def test_problems_are_correct_seeded_and_scored_as_gsm8k():
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
    r = task.problem(random.Random(5), reworded=True)
    assert r["question"].startswith("How many ") and r["answer"] == task.problem(random.Random(5))["answer"]
    assert len(task.all_steps()) == 6480 and len(task.held_out_steps(3)) == 648


def test_splits_share_no_tuple_and_hold_out_steps(tmp_path):
    kw = dict(seed=3, train=300, val=40, test=60, heldout=30, reworded=30, full_text=0.25)
    a = task.make_splits(tmp_path / "a", **kw)
    b = task.make_splits(tmp_path / "b", **kw)
    for split in a["paths"]:
        assert open(a["paths"][split]).read() == open(b["paths"][split]).read()
    read = lambda split: [json.loads(line) for line in open(a["paths"][split])]  # noqa: E731
    train = read("train")
    full = [r for r in train if r["prompt"] == "Question:"]
    assert len(train) == 340 and 40 < len(full) < 120 and a["full_text_rows"] == len(full)
    assert all(r["prompt"] != "Question:" for r in train[300:])  # validation rows: prompt / answer only
    assert [f"Question: {r['question']}\nAnswer:" for r in read("val")] == [r["prompt"] for r in train[300:]][:300]

    def parse(question, answer):  # (a, op1, b, op2, c) and the steps, from the text
        (x1, o1, y1), (x2, o2, y2) = (re.match(r"(\d+)([+-])(\d+)=", line).groups() for line in answer.split("\n")[:2])
        return (int(x1), o1, int(y1), o2, int(y2)), [(int(x1), o1, int(y1)), (int(x2), o2, int(y2))]

    def of(r):
        if "question" in r:
            return parse(r["question"], r["answer"])
        return parse(None, r["completion"].split("Answer: ")[-1].strip())

    held = task.held_out_steps(3)
    train_tuples = {of(r)[0] for r in train}
    assert not any(s in held for r in train for s in of(r)[1])
    for split in ("test", "test_heldout", "test_reworded"):
        rows = read(split)
        assert not {of(r)[0] for r in rows} & train_tuples and len({of(r)[0] for r in rows}) == len(rows)
        assert all(any(s in held for s in of(r)[1]) == (split == "test_heldout") for r in rows)
    assert all(r["question"].startswith("How many ") for r in read("test_reworded"))


def test_infill_example_masks_a_number_only_the_suffix_fixes(tokenizer):
    row = {"question": "Ann has 47 apples. Ann buys 38 and then gives away 19. How many apples does Ann have?",
           "answer": "47+38=85.\n85-19=66.\n#### 66"}
    e = task.infill_example(row, tokenizer)
    assert e["span_text"] == " 19"
    assert tokenizer.decode(e["prefix"]) == "Question: Ann has 47 apples. Ann buys 38 and then gives away"
    assert tokenizer.decode(e["prefix"] + e["span"] + e["suffix"][:-1]) == (
        f"Question: {row['question']}\nAnswer: {row['answer']}")
    assert e["suffix"][-1] == tokenizer.eos_id and "85-19=66." in tokenizer.decode(e["suffix"])


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


@pytest.mark.parametrize("order", ["sliding_window", "any_order"])
def test_naive_inputs_predict_the_masked_set_from_the_revealed_one(setdlm, order):
    from model.config import ObjectiveConfig
    from model.objectives import build_objective

    model, obj = setdlm
    if order == "any_order":
        obj = build_objective(ObjectiveConfig(name="setdlm", set_size=16, order="any_order"), model.cfg, 16)
    b = _batch()
    inp = mm.naive_inputs(obj, b, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)  # the same draws: masking times (uniform on any_order), then one per row
    T = obj.schedule.masking_times(6, g) if order == "sliding_window" else torch.rand((6, 16), generator=g, dtype=torch.float64)
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
def test_comparisons_are_welch_t_tests_with_their_p():
    from scipy import stats

    a, b = [0.60, 0.62, 0.64, 0.61, 0.63], [0.50, 0.52, 0.55]
    got = mc.compare(mc.seed_summary(a), mc.seed_summary(b), "x")
    ref = stats.ttest_ind(a, b, equal_var=False)
    assert got["test"].startswith("Welch") and got["p"] == pytest.approx(ref.pvalue) and got["t"] == pytest.approx(ref.statistic)
    assert got["verdict"] == "held" and mc.compare(b, a, "x")["verdict"] == "contradicted"
    assert got["ci95"][0] < got["difference"] < got["ci95"][1]
    # the first version's z = 2.02 over 3 seeds is p = 0.18 under Welch's t (2 degrees of freedom)
    m = 2.02 / math.sqrt(3)
    z = mc.compare([m - 1.0, m, m + 1.0], [0.0, 0.0, 0.0], "x")
    assert z["df"] == pytest.approx(2.0) and z["p"] == pytest.approx(0.18, abs=0.005) and z["verdict"] == "not resolved"
    assert mc.combine(["held", "held"]) == "held" and mc.combine(["held", "not resolved"]) == "not resolved"
    assert mc.combine(["held", "contradicted"]) == "contradicted"


def test_holm_levels_and_the_gate():
    parts = mc.holm([{"p": 0.02, "difference": 1.0}, {"p": 0.01, "difference": -1.0}, {"p": 0.2, "difference": 1.0}])
    assert [p["level"] for p in parts] == pytest.approx([0.05 / 2, 0.05 / 3, 0.05])
    assert [p["verdict"] for p in parts] == ["held", "contradicted", "not resolved"]
    parts = mc.holm([{"p": 0.02, "difference": 1.0}, {"p": 0.04, "difference": 1.0}, {"p": 0.001, "difference": 1.0}])
    assert [p["verdict"] for p in parts] == ["held", "held", "held"]  # 0.001 < 0.05/3, 0.02 < 0.05/2, 0.04 < 0.05
    parts = mc.holm([{"p": 0.02, "difference": 1.0}, {"p": 0.012, "difference": 1.0}])
    assert [p["verdict"] for p in parts] == ["held", "held"]
    parts = mc.holm([{"p": 0.03, "difference": 1.0}, {"p": 0.026, "difference": 1.0}])
    assert [p["verdict"] for p in parts] == ["not resolved", "not resolved"]  # 0.026 > 0.025: Holm stops
    g = mc.gate({1234: 0.9, 1235: 0.4}, 0.5)
    assert not g["passed"] and g["failed_seeds"] == {"1235": 0.4}
    claim = mc.gated({"verdict": "held"}, {"m": g, "n": mc.gate({1: 0.6}, 0.5)})
    assert claim["verdict"] == "not resolved" and claim["verdict_before_gate"] == "held" and "1235 (40%)" in claim["note"]


def test_frontier_compares_best_accuracy_at_least_as_parallel_on_the_shared_grid():
    assert mc.envelope([(1.0, 0.5), (2.0, 0.3), (3.1, 0.1)], 1.5) == 0.3 and mc.envelope([(1.0, 0.5)], 2.0) is None
    hi = {s: [(1.0, 0.60 + d), (2.0, 0.50 + d), (4.0, 0.2)] for s, d in ((1, 0.0), (2, 0.01), (3, 0.02))}
    lo = {s: [(1.0, 0.50 + d), (1.6, 0.30 + d)] for s, d in ((1, 0.0), (2, 0.01), (3, 0.02))}
    got = mc.frontier_claim({"setdlm": hi, "bd3lm": lo}, "setdlm", "bd3lm")
    assert got["grid_used"] == [0.9, 1.25, 1.5] and got["verdict"] == "held"  # 2.0+ is beyond bd3lm's reach
    assert got["scores"]["setdlm"]["mean"] == pytest.approx((0.61 + 0.51 + 0.51) / 3) and "p" in got["comparison"]
    assert mc.frontier_claim({"setdlm": lo, "bd3lm": hi}, "setdlm", "bd3lm")["verdict"] == "contradicted"
    assert mc.frontier_claim({"setdlm": hi, "bd3lm": hi}, "setdlm", "bd3lm")["verdict"] == "not resolved"
    far = {1: [(5.0, 0.1)]}
    assert mc.frontier_claim({"setdlm": far, "bd3lm": {1: [(0.5, 0.1)]}}, "setdlm", "bd3lm")["grid_used"] == []
    rows = {m: {"threshold 0.9": {"accuracy": mc.seed_summary(v), "tokens_per_forward": mc.seed_summary([2.0, 2.1])}}
            for m, v in (("a", [0.8, 0.82]), ("b", [0.3, 0.35]))}
    per = mc.per_threshold(rows, "a", "b")
    assert [t["setting"] for t in per] == ["threshold 0.9"] and per[0]["comparison"]["verdict"] == "held"


def test_likelihood_and_variance_claims():
    bounds = {"AR": [(1.0, 0.0), (1.01, 0.0), (1.02, 0.0)], "S": [(1.2, 0.001), (1.21, 0.001), (1.22, 0.0)],
              "B": [(1.5, 0.01), (1.52, 0.01), (1.51, 0.0)], "M": [(1.3, 0.01), (1.31, 0.01), (1.29, 0.0)]}
    got = mc.likelihood_claim(bounds, ["AR", "S", "B", "M"])
    assert [o["verdict"] for o in got["orderings"]] == ["held", "held", "contradicted"]
    assert got["verdict"] == "contradicted" and all("p" in o and "test" in o for o in got["orderings"])
    assert mc.likelihood_claim(bounds, ["AR", "S", "M"])["verdict"] == "held"
    per = [{"steps": [{"naive": {"variance": 3.0 * f * g}, "token_efficient": {"variance": 1.0}} for g in (0.8, 1.25)]}
           for f in (0.9, 1.0, 1.1, 1.05)]
    v = mc.variance_claim(per)
    assert v["ratio"] == pytest.approx(3.0 * math.exp(sum(math.log(f) for f in (0.9, 1.0, 1.1, 1.05)) / 4))
    assert v["verdict"] == "held" and v["comparison"]["test"].startswith("one-sample")
    assert v["ratio_ci95"][0] < v["ratio"] < v["ratio_ci95"][1]


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
    for argv, word in ((["--jobs", "0"], "--jobs"), (["--timed-only", "--out", str(tmp_path)], "--timed-only"),
                       (["--pilot-lr", "--train-only"], "--pilot-lr")):
        r = subprocess.run([sys.executable, script, *argv], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and word in r.stderr and "Traceback" not in r.stderr


# -- the pipeline's pieces --------------------------------------------------------------------------------
@pytest.mark.slow
def test_pipeline_pieces_write_every_claim_id(tmp_path, model_parallel, one_thread):
    """prepare -> train and measure each model (in this process) -> timed pass -> report, at a tiny size:
    the path `--smoke` takes, every claim with its test and p."""
    from benchmarks import miniature_spec as spec
    from benchmarks import paper_miniature as pm
    from benchmarks.miniature_report import write_report

    size = dict(spec.SIZES["smoke"], steps=2, variance_steps=(1, 2), warmup=1, train_rows=120, val_rows=32,
                test_rows=4, heldout_rows=2, reworded_rows=2, grad_draws=2, timed_prompts=1, timed_warmup=1,
                timed_repeats=1)
    out = tmp_path / "mini"
    spec_ = pm.prepare(out, size)
    assert spec_["prepare"].startswith("setdlm data prepare --format prompt_completion") and "OUT/" in spec_["prepare"]
    for slug in size["models"]:
        for seed in spec.seeds(size, slug):
            if seed == spec.BASE_SEED:  # --train-only: trained, nothing measured; the next call measures it
                pm.work(slug, seed, size, out, train_only=True)
                left = pm.missing(slug, seed, size, out)
                assert not any(w.startswith("trained/") for w in left) and (left or not spec.settings(slug, size))
            pm.work(slug, seed, size, out)
            assert pm.missing(slug, seed, size, out) == []
    pm.timed_pass(size, out, redo=False)
    phases = [{"started": "now", "load_start": [1, 1, 1], "load_end": [1, 1, 1], "seconds": 1.0,
               "argv": ["--smoke", "--out", str(out)]}]
    second = {"bd3lm-b4-seed101/step_2": {"accuracy": 0.5}, "lr": 1e-3, "steps": 2, "passed": True}
    path = write_report(out, out, size, smoke=True, phases=phases, pilot_lr=second)
    data = json.loads(path.read_text())
    assert data["run"]["learning_rates"]["bd3lm-b4"] == spec.PILOT_LR["lr"] != data["run"]["learning_rates"]["ar"]
    assert data["pilot_lr"]["passed"] and "## The second pilot" in (out / "paper_miniature.md").read_text()
    claims = {c["id"]: c for c in data["claims"]}
    assert list(claims) == ["frontier", "infill", "cache_ablation", "gradient_variance", "likelihood_order"]
    assert all(c["verdict"] in mc.VERDICTS for c in claims.values())
    for c in claims.values():
        parts = [c["comparison"]] if "comparison" in c else c["comparisons"]
        assert parts and all("test" in p and "p" in p for p in parts[:1])
    assert claims["gradient_variance"]["schedule"] == "any_order" and len(claims["gradient_variance"]["per_seed"]) == 2
    assert claims["infill"]["floor"]["label"] == "AR, prefix only"
    assert set(data["reasoning"]["gates"]) == set(spec.GATES)
    assert all(0.0 <= a <= 1.0 for a in data["reasoning"]["accuracy"].values())
    assert len(data["commit"]) == 40 and str(tmp_path) not in path.read_text()
    rows = {(r["model"], r["setting"]): r for r in data["settings"]}
    assert rows["mdlm", "8 steps"]["tokens_per_s"]["seeds"] == 2 and rows["ar", "greedy"]["accuracy"]["seeds"] == 2
    text = (out / "paper_miniature.md").read_text()
    assert "![frontier](paper_miniature.png)" in text and "| claim | paper | result here | test | verdict |" in text
    assert str(tmp_path) not in text and (out / "paper_miniature.png").stat().st_size > 1000


def test_benchmarks_modules_import_no_circle():
    """benchmarks/ imports form no cycle (the report once imported the script that imported it)."""
    import ast

    mods = {p.stem: p for p in (REPO / "benchmarks").glob("*.py")}
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("benchmarks"):
                parts = node.module.split(".")
                deps |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
        graph[name] = deps & set(mods)
    state: dict = {}

    def visit(n, stack):
        state[n] = "open"
        for d in graph[n]:
            assert state.get(d) != "open", f"import circle: {' -> '.join(stack + [n, d])}"
            if d not in state:
                visit(d, stack + [n])
        state[n] = "done"

    for n in graph:
        if n not in state:
            visit(n, [])
    assert graph["paper_miniature"] >= {"miniature_spec", "miniature_report"} and "paper_miniature" not in graph["miniature_report"]


def test_the_report_lists_stopped_invocations_and_takes_the_commit_of_the_one_that_finished():
    from benchmarks import miniature_report as mr

    stopped = {"started": "t0", "argv": ["--jobs", "2"], "commit": "a" * 40, "uncommitted_changes": False, "jobs": 2,
               "load_start": [1.0, 1.0, 1.0], "finished": False, "note": "killed"}
    done = {**stopped, "started": "t1", "commit": "b" * 40, "finished": True, "train_and_eval_seconds": 5.0,
            "load_end": [2.0, 2.0, 2.0], "seconds": 9.0, "note": None}
    assert "stopped before its end (killed)" in mr.invocation_text(stopped)
    assert "stopped" not in mr.invocation_text(done) and "`bbbbbbbbbbbb`" in mr.invocation_text(done)
    assert mr.load_text([stopped, done]) == "t0: start 1.0/1.0/1.0, end -; t1: start 1.0/1.0/1.0, end 2.0/2.0/2.0"
    assert mr.jobs_text([stopped, done]) == "2 models at a time" and mr.jobs_text([]) == "1 model at a time"
