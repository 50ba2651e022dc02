"""lm-evaluation-harness integration: a registered LM class and an offline GSM8K task definition.

- `SetDLMLM` (eval/lmeval_model.py) is registered with the harness as ``setdlm``, so after ``import eval.lmeval``
  ``lm_eval.simple_evaluate(model="setdlm", model_args="checkpoint=RUN_DIR,threshold=0.9", ...)``
  decodes any generation task with our samplers (loglikelihood requests are not supported: set
  diffusion models give bounds, not exact conditional likelihoods, except AR checkpoints).
- `write_task` writes a task YAML (+ its scoring hook) that reads a local JSONL with the
  ``json`` dataset builder (offline) or the hub dataset (``--data hub``): for plain prompts our
  ``setdlm_gsm8k`` (``Question: ..\\nAnswer:``, our answer extraction), for chat prompts **lm-eval's
  own ``gsm8k`` task** (its YAML included as it is installed: prompt, stop sequences, strict-match and
  flexible-extract filters), only the data files replaced.
- Chat prompts: the LM classes implement lm-eval's chat API (``apply_chat_template``,
  ``tokenizer_name``, ``chat_template``) with the checkpoint tokenizer's template
  (eval/chat_prompt.py), and ``simple_evaluate(apply_chat_template=True)`` renders every request
  through it, as for a Hugging Face model: the paper's protocol (``--protocol paper``).
- `run_generation` is the `setdlm eval gsm8k --backend lm-eval` path: the harness builds the requests
  (prompts, few-shot, stop sequences) on every rank; `_CollectLM.generate_until` hands them to the
  sharded, resumable runner, which decodes this rank's units; the merge replays all records through
  the harness (`replay_metrics`), which then scores exactly what was generated.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .errors import EvalError
from .lmeval_chat import ChatAPI, GenerationOnly, _base
from .lmeval_model import SetDLMLM  # noqa: F401 - registers "setdlm" with the harness (eval.lmeval.SetDLMLM)
from .overlong import sort_overlong
from .records import RecordReader, atomic_write
from .units import Unit

TASK = "setdlm_gsm8k"
OWN_TASK = "gsm8k"  # lm-eval's own task (chat prompts)

_UTILS = '''"""Scoring hook of the setdlm GSM8K task (written by setdlm eval)."""
from eval.metrics import extract_answer, gold_answer


def process_results(doc, results):
    pred, _ = extract_answer(results[0])
    return {"exact_match": float(pred is not None and pred == gold_answer(doc["answer"]))}
'''


def _q(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid YAML scalar


def _data_lines(spec: dict, hub: list[str]) -> list[str]:
    if spec["data"] == "hub":
        return hub + (["fewshot_split: train"] if spec.get("fewshot") else [])
    files = {"test": str(Path(spec["data"]).resolve())}
    if spec.get("fewshot"):
        files["train"] = str(Path(spec["fewshot_data"]).resolve())
    lines = ["dataset_path: json", "dataset_kwargs:", "  data_files:"]
    lines += [f"    {k}: {_q(v)}" for k, v in files.items()]
    return lines + ["test_split: test"] + (["fewshot_split: train"] if spec.get("fewshot") else [])


def own_task_yaml() -> Path:
    """lm-eval's own gsm8k task definition, as installed."""
    import lm_eval

    return Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"


def task_name(spec: dict) -> str:
    return OWN_TASK if spec.get("lm_eval_task") == OWN_TASK else TASK


def write_task(out: Path, spec: dict) -> Path:
    """The task directory (YAML + scoring hook) for this run's data; same content on every rank."""
    d = Path(out) / "lm_eval_task"
    d.mkdir(parents=True, exist_ok=True)
    if task_name(spec) == OWN_TASK:  # lm-eval's gsm8k as it is, only the data files replaced
        lines = [f"include: {_q(str(own_task_yaml()))}", f"task: {OWN_TASK}"]
        if spec["data"] != "hub":  # the json builder has no 'main' config, and no train split unless few-shot
            lines += _data_lines(spec, []) + ["dataset_name: null", "training_split: null"]
            lines += [] if spec.get("fewshot") else ["fewshot_split: null"]
        atomic_write(d / f"{OWN_TASK}.yaml", "\n".join(lines) + "\n")
        return d
    lines = [f"task: {TASK}"]
    lines += _data_lines(spec, ["dataset_path: openai/gsm8k", "dataset_name: main", "test_split: test"])
    lines += [
        "output_type: generate_until",
        "doc_to_text: " + _q(spec["template"].replace("{question}", "{{question}}")),
        'doc_to_target: "{{answer}}"',
        'target_delimiter: " "',
        'fewshot_delimiter: "\\n\\n"',
        "process_results: !function setdlm_utils.process_results",
        "metric_list:",
        "  - metric: exact_match",
        "    aggregation: mean",
        "    higher_is_better: true",
        "generation_kwargs:",
        '  until: ["Question:"]',
        "  do_sample: false",
        "metadata:",
        "  version: 1",
    ]
    atomic_write(d / f"{TASK}.yaml", "\n".join(lines) + "\n")
    atomic_write(d / "setdlm_utils.py", _UTILS)
    return d


def _evaluate(lm, out: Path, spec: dict):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
    d = write_task(out, spec)
    tm = TaskManager(include_path=str(d), include_defaults=False)  # quiet through the loggers above
    chat = bool(spec.get("chat"))
    lm.chat_spec = spec.get("chat")
    return simple_evaluate(model=lm, tasks=[task_name(spec)], task_manager=tm, num_fewshot=spec.get("fewshot") or 0,
                           limit=spec.get("limit") or None, bootstrap_iters=0, log_samples=False, verbosity="ERROR",
                           random_seed=0, numpy_random_seed=1234, torch_random_seed=1234,
                           fewshot_random_seed=int(spec.get("seed") or 0) + 1234,
                           **({"apply_chat_template": True, "fewshot_as_multiturn": True} if chat else {}))


def _fit_requests(task, items: list[dict], histories: dict) -> None:
    """--overlong on the harness's prompts (the few-shot ones exist only now): sets each item's
    `skip` (tokens needed, or None), `input` (what it decodes from) and `cut`. Error refuses here;
    skip gives the prompts that do not fit a skip record instead of a generation; truncate cuts a
    chat prompt inside its last user turn's content (text: the predictor keeps its end)."""
    for x in items:
        x.update(skip=None, input=x["prompt"], cut=0)
    if task.ckpt is None:
        return
    chat = task.chat_prompts
    if chat is not None:
        for x in items:
            x["input"] = chat.ids(x["prompt"])
    sizes = [task.needs(x["input"]) for x in items]
    floors = None
    if chat is not None and task.args.overlong == "truncate":
        floors = [chat.floor(histories[x["prompt"]]) + task.span_room() if x["prompt"] in histories else n
                  for x, n in zip(items, sizes)]
    what = f"problems (the harness's prompts{task._with_new()})"
    keep = set(sort_overlong([x["id"] for x in items], sizes, task.limit, task.args.overlong, what=what, floors=floors)[0])
    for i, x in enumerate(items):
        if i not in keep:
            x["skip"] = sizes[i]
        elif chat is not None and x["prompt"] in histories:
            x["input"], x["cut"] = task.fitted(x["input"], histories[x["prompt"]])


def run_generation(task, run, after_unit=None) -> dict:
    """Generation phase of the lm-eval backend (every rank builds all requests, decodes its units)."""
    LM = _base()
    stats: dict = {}

    class _CollectLM(ChatAPI, GenerationOnly, LM):
        def generate_until(self, requests, disable_tqdm: bool = False):
            reqs = sorted(requests, key=lambda r: r.doc_id)
            items = [{"id": str(r.doc_id), "doc": r.doc, "prompt": r.arguments[0],
                      "until": list(r.arguments[1].get("until") or [])} for r in reqs]
            _fit_requests(task, items, getattr(self, "histories", None) or {})
            units = [Unit(u.index, u.keys, u.payload) for u in _chunks(items, task.args.batch_size)]

            def fn(unit):
                xs = unit.payload
                return task._records(unit, [x["doc"] for x in xs], [x["prompt"] for x in xs], xs[0]["until"],
                                     skip={i: x["skip"] for i, x in enumerate(xs) if x["skip"] is not None},
                                     inputs=[x["input"] for x in xs], cuts=[x["cut"] for x in xs])

            stats.update(run.execute(units, fn, after_unit=after_unit))
            recs = RecordReader(run.out).refresh()
            return [recs.get(str(r.doc_id), {}).get("generation", "") for r in requests]

    _evaluate(_CollectLM(), run.out, run.spec)
    return stats


def _chunks(items, bs):
    from .tasks.base import chunk_units

    return chunk_units(items, bs)


def replay_metrics(out: Path, records: list[dict], spec: dict) -> dict:
    """Score the records with the harness (the merge of the lm-eval backend)."""
    try:
        LM = _base()
    except EvalError:
        return {"lm_eval/note": "lm-evaluation-harness not installed at merge time: harness metric not computed"}
    by_key = {r["key"]: r for r in records}

    class _ReplayLM(ChatAPI, GenerationOnly, LM):
        def generate_until(self, requests, disable_tqdm: bool = False):
            outs = []
            for r in requests:
                rec = by_key.get(str(r.doc_id))
                if rec is None:
                    outs.append("")
                    continue
                if rec.get("prompt") != r.arguments[0]:
                    raise EvalError(f"merge: the harness builds another prompt for example {r.doc_id} than the one "
                                    f"generated from (the data or lm-eval changed); rerun the evaluation")
                outs.append(rec["generation"])
            return outs

    res = _evaluate(_ReplayLM(), Path(out), spec)
    name = task_name(spec)
    r = res["results"][name]
    import lm_eval

    version = getattr(lm_eval, "__version__", "?")
    if name == OWN_TASK:  # lm-eval's own filters: the "#### n" line (strict) and the last number (flexible)
        return {"lm_eval/exact_match": r.get("exact_match,strict-match"),
                "lm_eval/exact_match_flexible": r.get("exact_match,flexible-extract"),
                "lm_eval/task": f"gsm8k (lm-eval {version}'s own task, apply_chat_template)", "lm_eval/version": version}
    return {"lm_eval/exact_match": r.get("exact_match,none"), "lm_eval/version": version}
