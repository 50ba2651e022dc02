"""lm-evaluation-harness integration: a registered LM class and an offline GSM8K task definition.

- `SetDLMLM` is registered with the harness as ``setdlm``, so after ``import eval.lmeval``
  ``lm_eval.simple_evaluate(model="setdlm", model_args="checkpoint=RUN_DIR,threshold=0.9", ...)``
  decodes any generation task with our samplers (loglikelihood requests are not supported: set
  diffusion models give bounds, not exact conditional likelihoods, except AR checkpoints).
- `write_task` writes a task YAML (+ its scoring hook) that reads a local JSONL with the
  ``json`` dataset builder (offline) or the hub dataset (``--data hub``).
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
from .overlong import sort_overlong
from .records import RecordReader, atomic_write
from .units import Unit

TASK = "setdlm_gsm8k"

_UTILS = '''"""Scoring hook of the setdlm GSM8K task (written by setdlm eval)."""
from eval.metrics import extract_answer, gold_answer


def process_results(doc, results):
    pred, _ = extract_answer(results[0])
    return {"exact_match": float(pred is not None and pred == gold_answer(doc["answer"]))}
'''


def _q(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid YAML scalar


def write_task(out: Path, spec: dict) -> Path:
    """The task directory (YAML + scoring hook) for this run's data; same content on every rank."""
    d = Path(out) / "lm_eval_task"
    d.mkdir(parents=True, exist_ok=True)
    lines = [f"task: {TASK}"]
    if spec["data"] == "hub":
        lines += ["dataset_path: openai/gsm8k", "dataset_name: main", "test_split: test"]
        if spec.get("fewshot"):
            lines += ["fewshot_split: train"]
    else:
        files = {"test": str(Path(spec["data"]).resolve())}
        if spec.get("fewshot"):
            files["train"] = str(Path(spec["fewshot_data"]).resolve())
        lines += ["dataset_path: json", "dataset_kwargs:", "  data_files:"]
        lines += [f"    {k}: {_q(v)}" for k, v in files.items()]
        lines += ["test_split: test"] + (["fewshot_split: train"] if spec.get("fewshot") else [])
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


def _base():
    try:
        from lm_eval.api.model import LM
    except ImportError:
        raise EvalError("lm-evaluation-harness is not installed: pip install 'setdlm[lm-eval]'") from None
    return LM


def _evaluate(lm, out: Path, spec: dict):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
    d = write_task(out, spec)
    tm = TaskManager(include_path=str(d), include_defaults=False, verbosity="ERROR")
    return simple_evaluate(model=lm, tasks=[TASK], task_manager=tm, num_fewshot=spec.get("fewshot") or 0,
                           limit=spec.get("limit") or None, bootstrap_iters=0, log_samples=False, verbosity="ERROR",
                           random_seed=0, numpy_random_seed=1234, torch_random_seed=1234,
                           fewshot_random_seed=int(spec.get("seed") or 0) + 1234)


def run_generation(task, run, after_unit=None) -> dict:
    """Generation phase of the lm-eval backend (every rank builds all requests, decodes its units)."""
    LM = _base()
    stats: dict = {}

    class _CollectLM(LM):
        def generate_until(self, requests, disable_tqdm: bool = False):
            reqs = sorted(requests, key=lambda r: r.doc_id)
            items = [{"id": str(r.doc_id), "doc": r.doc, "prompt": r.arguments[0],
                      "until": list(r.arguments[1].get("until") or [])} for r in reqs]
            # --overlong on the harness's prompts (the few-shot ones exist only now): error refuses here,
            # skip gives the prompts that do not fit a skip record instead of a generation
            sizes, keep = [0] * len(items), set(range(len(items)))
            if task.ckpt is not None:
                sizes = [task.needs(x["prompt"]) for x in items]
                keep = set(sort_overlong([x["id"] for x in items], sizes, int(task.ckpt.cfg.model.max_seq_len),
                                         task.args.overlong, what="problems (the harness's prompts + --max-new-tokens)")[0])
            for i, x in enumerate(items):
                x["skip"] = None if i in keep else sizes[i]
            units = [Unit(u.index, u.keys, u.payload) for u in _chunks(items, task.args.batch_size)]

            def fn(unit):
                return task._records(unit, [x["doc"] for x in unit.payload], [x["prompt"] for x in unit.payload],
                                     unit.payload[0]["until"],
                                     skip={i: x["skip"] for i, x in enumerate(unit.payload) if x["skip"] is not None})

            stats.update(run.execute(units, fn, after_unit=after_unit))
            recs = RecordReader(run.out).refresh()
            return [recs.get(str(r.doc_id), {}).get("generation", "") for r in requests]

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("setdlm gsm8k: loglikelihood requests are not used")

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("setdlm gsm8k: loglikelihood requests are not used")

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

    class _ReplayLM(LM):
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

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError

    res = _evaluate(_ReplayLM(), Path(out), spec)
    r = res["results"][TASK]
    import lm_eval

    return {"lm_eval/exact_match": r.get("exact_match,none"), "lm_eval/version": getattr(lm_eval, "__version__", "?")}


# ------------------------------------------------------------------------------------------ registered LM
def _register():
    try:
        from lm_eval.api.registry import register_model
    except ImportError:
        return None
    LM = _base()

    @register_model("setdlm")
    class SetDLMLM(LM):
        """lm-eval LM for setdlm checkpoints (generate_until only).

        model_args: checkpoint=RUN_DIR, and optionally family, window, threshold, block_size,
        max_new_tokens, temperature, batch_size, device, ema."""

        def __init__(self, checkpoint: str, family=None, window=None, threshold=0.9, block_size=None,
                     max_new_tokens=256, temperature=0.0, batch_size=1, device=None, ema=True, **_):
            super().__init__()
            from .models import Checkpoint, ModelPredictor, pick_device
            from .options import DecodingOptions, sampling_config

            self.ckpt = Checkpoint(checkpoint, ema=str(ema).lower() not in ("0", "false"), device=pick_device(0, device))
            opts = DecodingOptions(family=family, window=int(window) if window else None,
                                   threshold=None if threshold in (None, "none") else float(threshold),
                                   block_size=int(block_size) if block_size else None, temperature=float(temperature),
                                   max_new_tokens=int(max_new_tokens))
            self.predictor = ModelPredictor(self.ckpt, sampling_config(self.ckpt.cfg.objective, opts))
            self.bs = int(batch_size)

        def generate_until(self, requests, disable_tqdm: bool = False):
            outs = []
            for i in range(0, len(requests), self.bs):
                group = requests[i:i + self.bs]
                until = list(group[0].arguments[1].get("until") or [])
                res = self.predictor.complete([r.arguments[0] for r in group], seed=i, stop=until)
                outs += [o["text"] for o in res]
            return outs

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("setdlm: loglikelihood requests are not supported (use setdlm eval likelihood)")

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("setdlm: use setdlm eval likelihood")

    return SetDLMLM


try:
    SetDLMLM = _register()
except Exception:  # noqa: BLE001 - registering twice (re-import) or an incompatible harness
    SetDLMLM = None
