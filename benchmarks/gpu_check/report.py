"""The report: a JUnit file's summary and the markdown tables of report.md (standard library only)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path


def junit_summary(path: Path) -> dict:
    """Counts, failures (test id and first line of the message), skip reasons and every case (test id,
    outcome, skip reason) of a JUnit file."""
    if not path.is_file():
        return {"found": False}
    root = ET.parse(path).getroot()
    out = {"found": True, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skips": {},
           "cases": []}
    for case in root.iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            key = "failed" if "failure" in kinds else "errors"
            out[key] += 1
            el = kinds.get("failure", kinds.get("error"))
            msg = (el.get("message") or el.text or "").strip().splitlines()
            out["failures"].append({"test": tid, "kind": key, "message": (msg[0] if msg else "")[:300]})
            out["cases"].append({"test": tid, "outcome": key})
        elif "skipped" in kinds:
            out["skipped"] += 1
            reason = (kinds["skipped"].get("message") or "").strip()[:200]
            out["skips"][reason] = out["skips"].get(reason, 0) + 1
            out["cases"].append({"test": tid, "outcome": "skipped", "reason": reason})
        else:
            out["passed"] += 1
            out["cases"].append({"test": tid, "outcome": "passed"})
    return out


def _table(rows: list[dict], cols: list[tuple[str, str]]) -> list[str]:
    lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        cells = []
        for _, key in cols:
            v = r.get(key)
            if key == "mfu" and isinstance(v, float):
                v = f"{100 * v:.1f}%"
            elif isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10000:
                v = f"{v:,}"
            elif isinstance(v, float):
                v = f"{v:,.1f}" if abs(v) >= 100 else (f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}")
            cells.append("-" if v is None else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(report: dict) -> str:
    env = report.get("env") or {}
    reh = report.get("rehearsal")
    kind = ("REHEARSAL on the CPU in a venv built like the GPU image: numbers mean nothing" if reh else
            "CPU SMOKE RUN: numbers mean nothing" if report["smoke"] else "GPU run")
    head = (f"# GPU check report ({kind})\n\n"
            f"{report['started']} UTC, {env.get('device_name', 'device unknown')}, torch {env.get('torch', '?')} "
            f"(CUDA {env.get('cuda', '-')}), driver {env.get('driver', '-')}, Python {env.get('python', '?')}; "
            f"{report['elapsed_s']:.0f}s of a {report['budget_s']:.0f}s budget.\n")
    if reh and reh.get("emulated_python"):
        head += (f"\nNo Python 3.12 was found here: the image's package set was emulated on Python "
                 f"{reh['python']}.\n")
    out = [head]
    if reh is not None:
        rwhy = reh.get("verdict")
        out += ["## Rehearsal: " + ("still running" if rwhy is None else "FAILED" if rwhy else
                                    "passed (every part ok or partial, every gpu test collected)"), ""]
        out += [f"- {reason}" for reason in rwhy or []] + ([""] if rwhy else [])
    why = report.get("verdict")  # None until every part has run
    out += ["## Verdict: " + ("still running" if why is None else "FAILED" if why else "passed"), ""]
    out += [f"- {reason}" for reason in why or []] + ([""] if why else [])
    out += ["## Parts", ""]
    out += _table([{"part": k, **{kk: vv for kk, vv in v.items() if kk in ("status", "seconds", "limit_s", "reason")}}
                   for k, v in report["parts"].items()],
                  [("part", "part"), ("status", "status"), ("seconds", "seconds"), ("limit (s)", "limit_s"),
                   ("note", "reason")])
    inst = report.get("install") or {}
    if inst:
        out += ["", f"Install: {inst.get('status')}; installed: "
                + (", ".join(f"{i['name']} {i['version']}" for i in inst.get("installed", [])) or "nothing")
                + "; errors: " + ("; ".join(inst.get("errors", [])) or "none")]
    if env.get("imports"):
        out += ["", "Imports: " + ", ".join(f"{k} {v}" for k, v in env["imports"].items())]
    t = report.get("tests") or {}
    if t.get("found"):
        out += ["", "## gpu tests", "",
                f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped."]
        for f in t["failures"]:
            out.append(f"- FAILED `{f['test']}`: {f['message']}")
        for reason, n in t["skips"].items():
            out.append(f"- skipped ({n}): {reason}")
    elif "tests" in report["parts"]:
        out += ["", "## gpu tests", "", "No JUnit file was written (see the part's status and gpu_check.log)."]
    train = report["parts"].get("train", {}).get("rows", [])
    if train:
        out += ["", "## Training throughput (flex attention on CUDA, DeepSpeed ZeRO-1, one device)", "",
                f"MFU against {report['peak_tflops']} TFLOP/s; step = median of the timed steps after warm-up "
                "(compile excluded); tokens = sequences x L.", ""]
        out += _table(train, [("model", "preset"), ("objective", "objective"), ("L", "seq_len"),
                              ("micro-batch", "micro_batch"), ("precision", "precision"), ("act. ckpt", "activation_checkpointing"),
                              ("step (ms)", "step_ms"), ("tokens/s", "tokens_per_s"), ("TFLOP/s", "tflops"),
                              ("MFU", "mfu"), ("peak mem (GiB)", "peak_mem_gib"), ("loss", "loss"), ("note", "note")])
        predicted = [r for r in train if r.get("predicted_ms")]
        if predicted:
            out += ["", "## Predicted vs measured step time (the dry run's model, one device)", "",
                    "predicted: pretrain/steptime.py for the case on the GPU's preset (pretrain/hardware.py): compute at "
                    "the matmul and attention efficiencies, memory-bound work at HBM bandwidth, no communication on "
                    "one device. A ratio far from 1 says which assumption to revisit (docs/parallelism.md).", ""]
            out += _table(predicted, [("model", "preset"), ("objective", "objective"), ("micro-batch", "micro_batch"),
                                      ("measured (ms)", "step_ms"), ("predicted (ms)", "predicted_ms"),
                                      ("compute (ms)", "predicted_compute_ms"), ("memory-bound (ms)", "predicted_memory_ms"),
                                      ("measured / predicted", "measured_over_predicted"), ("rates", "hardware"),
                                      ("note", "prediction_note")])
    dec = report["parts"].get("decode", {}).get("rows", [])
    if dec:
        out += ["", "## Decoding throughput (random weights, greedy)", "",
                "tokens/s: generated tokens over wall time (prefill included); forwards/s: decoding forwards "
                "(one per step of the batch) over wall time; tokens/step: per sequence.", ""]
        out += _table(dec, [("sampler", "sampler"), ("mode", "mode"), ("batch", "batch"), ("tokens/s", "tokens_per_s"),
                            ("forwards/s", "forwards_per_s"), ("tokens/step", "tokens_per_step"),
                            ("seconds", "seconds"), ("note", "note")])
    return "\n".join(out) + "\n"
