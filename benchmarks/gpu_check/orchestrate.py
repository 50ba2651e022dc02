"""Runs the check's parts, each in its own process under its own time limit (all of them under the
budget), and rewrites report.json / report.md after every part (standard library only: it must run
even where the stack does not import)."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import rows
from .part_tests import selection
from .report import junit_summary, markdown
from .verdict import verdict

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "benchmarks" / "gpu_report.py"
PARTS = ("install", "env", "tests", "train", "decode")
# Seconds per part on the GPU machine (they sum to the default budget); --cpu-smoke uses its own.
GPU_LIMITS = {"install": 40, "env": 40, "tests": 120, "train": 190, "decode": 80}
SMOKE_LIMITS = {"install": 60, "env": 120, "tests": 120, "train": 300, "decode": 300}  # a loaded 2-core CI machine
CUDA_PROBE = ("import json, torch; ok = torch.cuda.is_available(); print(json.dumps({'visible': ok, 'devices': "
              "torch.cuda.device_count(), 'name': torch.cuda.get_device_name(0) if ok else None}))")


class Log:
    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)
        self.t0 = time.monotonic()

    def __call__(self, part: str, line: str) -> None:
        text = f"[{part} {time.monotonic() - self.t0:6.1f}s] {line}"
        print(text, flush=True)
        self.f.write(text + "\n")


def run_part(name: str, cmd: list[str], limit: float, env: dict, log: Log) -> dict:
    """Run one part; stream its output; stop it (SIGTERM, then SIGKILL) at its limit."""
    if limit <= 1:
        log(name, "skipped: no time left in the budget")
        return {"status": "skipped", "reason": "no time left in the budget", "seconds": 0.0, "rows": []}
    log(name, f"start (limit {limit:.0f}s): {' '.join(cmd[:6])}{' ...' if len(cmd) > 6 else ''}")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    found: list = []
    tail: list[str] = []

    def reader():
        for line in proc.stdout:
            line = line.rstrip("\n")
            row = rows.parse(line)
            if row is not None:
                found.append(row)
            tail.append(line)
            del tail[:-40]
            log(name, line)

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    status = "ok"
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        status = "timeout"
        log(name, f"time limit {limit:.0f}s reached: stopping it")
        for sig, grace in ((signal.SIGINT, 15), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
    th.join(timeout=5)
    rc = proc.returncode
    if status == "ok" and rc != 0:
        status = "failed"
    secs = time.monotonic() - t0
    log(name, f"{status} (exit {rc}) after {secs:.1f}s")
    return {"status": status, "exit": rc, "seconds": round(secs, 1), "rows": found, "tail": tail[-15:]}


def parse_limits(items: list[str], base: dict) -> dict:
    limits = dict(base)
    for item in items:
        name, _, value = item.partition("=")
        if name not in PARTS or not value:
            raise SystemExit(f"gpu_report: --limit {item!r}: expected PART=SECONDS with PART in {', '.join(PARTS)}")
        try:
            limits[name] = float(value)
        except ValueError:
            raise SystemExit(f"gpu_report: --limit {item!r}: {value!r} is not a number of seconds") from None
    return limits


def probe_cuda(env: dict) -> dict:
    """Whether a fresh process of this interpreter sees a CUDA device (the verdict needs one)."""
    try:
        r = subprocess.run([sys.executable, "-c", CUDA_PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    except subprocess.TimeoutExpired:
        return {"visible": False, "detail": "the probe (import torch) timed out"}
    if r.returncode != 0:
        return {"visible": False, "detail": "the probe failed: " + (r.stderr.strip().splitlines() or ["?"])[-1][:200]}
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if not out["visible"]:
        out["detail"] = "torch.cuda.is_available() is False" + (
            "; CUDA_VISIBLE_DEVICES is empty" if env.get("CUDA_VISIBLE_DEVICES") == "" else "")
    return out


def orchestrate(args) -> int:
    out = Path(args.out or os.environ.get("OUT") or REPO / "gpu_report").resolve()
    out.mkdir(parents=True, exist_ok=True)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        print(f"gpu_report: --parts: unknown part {bad[0]!r}; valid: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    limits = parse_limits(args.limit, SMOKE_LIMITS if args.cpu_smoke else GPU_LIMITS)
    log = Log(out / "gpu_check.log")
    work = Path(tempfile.mkdtemp(prefix="gpu_report_"))
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.pathsep.join(
                   [str(REPO), args.site] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])))
    if args.cpu_smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    start, t0 = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    report = {"started": start.strftime("%Y-%m-%d %H:%M:%S"), "smoke": bool(args.cpu_smoke), "budget_s": args.budget,
              "peak_tflops": args.peak_tflops, "argv": sys.argv[1:], "parts": {}, "elapsed_s": 0.0}
    report["cuda"] = probe_cuda(env)
    log("cuda", json.dumps(report["cuda"]))
    py = sys.executable
    me = str(ENTRY)
    common = ["--smoke"] if args.cpu_smoke else []

    def write():
        report["elapsed_s"] = round(time.monotonic() - t0, 1)
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "report.md").write_text(markdown(report))

    for name in parts:
        remaining = args.budget - (time.monotonic() - t0) - 5
        limit = min(limits[name], remaining)
        if name == "install":
            rep = work / "install.json"
            cmd = [py, str(REPO / "scripts" / "install_wheels.py"), "--wheels", args.wheels, "--target", args.site,
                   "--report", str(rep)] + (["--skip-incompatible"] if args.cpu_smoke else [])
            res = run_part(name, cmd, limit, env, log)
            if rep.is_file():
                report["install"] = json.loads(rep.read_text())
        elif name == "tests":
            junit = out / "tests.xml"
            junit.unlink(missing_ok=True)
            cmd = [py, me, "--part", "tests", "--junit", str(junit), "--deadline", str(limit),
                   "--workers", str(args.workers)] + common
            res = run_part(name, cmd, limit, env, log)
            report["tests"] = {**junit_summary(junit), "selection": selection(args.cpu_smoke)}
        else:
            cmd = [py, me, "--part", name, "--deadline", str(limit), "--peak-tflops", str(args.peak_tflops),
                   "--workdir", str(work)] + common
            res = run_part(name, cmd, limit, env, log)
            if name == "env" and res["rows"]:
                report["env"] = res["rows"][-1]  # the fullest one the part got to print
        res["limit_s"] = round(limit, 1)
        if name == "env":
            res["rows"] = []
        report["parts"][name] = res
        write()
    report["verdict"] = verdict(report)
    write()
    log("report", f"wrote {out / 'report.json'} and {out / 'report.md'}")
    print(markdown(report))
    for reason in report["verdict"]:
        log("verdict", f"FAILED: {reason}")
    return 1 if report["verdict"] else 0
