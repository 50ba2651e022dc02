"""Runs the check's parts, each in its own process under its own time limit (all of them under the
budget), and rewrites report.json / report.md after every part (standard library only: it must run
even where the stack does not import).

The limits form a schedule: part i may run until the sum of the limits of the parts up to i, so the
time a quick part leaves goes to the ones after it, and no part runs past the budget (a limit given
with --limit is a hard cap on that part). A deadline
counts from the start of the part's process (the part gets it as a wall-clock time), its imports
included. Every part shares one inductor / Triton cache (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR
under the temporary folder, kept between runs), so a kernel compiled once, by a test worker, a part
or an earlier run on the same machine, is not compiled again. The remaining budget is printed at
every part's start and end and every HEARTBEAT seconds while a part runs."""

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
from .verdict import rehearsal_verdict, verdict

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "benchmarks" / "gpu_report.py"
PARTS = ("install", "env", "tests", "train", "decode")
BENCHMARKS = ("train", "decode")  # parts whose rows stand on their own: out of time after some rows is `partial`
# Seconds per part on the GPU machine; --cpu-smoke (and --rehearse) use their own. The whole check must
# end within 8 minutes: GPU_BUDGET plus the CUDA probe's start and the last part's stop (GRACE).
GPU_LIMITS = {"install": 30, "env": 30, "tests": 150, "train": 145, "decode": 95}
GPU_BUDGET = 460.0
SMOKE_LIMITS = {"install": 60, "env": 120, "tests": 180, "train": 300, "decode": 300}  # a loaded 2-core CI machine
GRACE = 10.0  # what stopping a part may take past its limit (SIGINT, SIGTERM, SIGKILL)
HEARTBEAT = 30.0
CACHE = Path(tempfile.gettempdir()) / "setdlm-gpu-check"  # compiled kernels, kept between runs on one machine
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


def run_part(name: str, cmd: list[str], limit: float, env: dict, log: Log, budget_left=lambda: None) -> dict:
    """Run one part; stream its output; stop it (SIGINT, SIGTERM, then SIGKILL) at its limit. The part
    gets its deadline as a wall-clock time (`--deadline-at`, appended here), counted from its start."""
    if limit <= 1:
        log(name, "skipped: no time left in the budget")
        return {"status": "skipped", "reason": "no time left in the budget", "seconds": 0.0, "rows": []}
    if cmd[-1] == "--deadline-at":
        cmd = cmd + [f"{time.time() + limit:.3f}"]
    left = budget_left()
    log(name, f"start (limit {limit:.0f}s{'' if left is None else f'; budget left {left:.0f}s'}): "
              f"{' '.join(cmd[:6])}{' ...' if len(cmd) > 6 else ''}")
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
    while proc.poll() is None:
        ran = time.monotonic() - t0
        if ran >= limit:
            status = "timeout"
            break
        try:
            proc.wait(timeout=min(HEARTBEAT, limit - ran))
        except subprocess.TimeoutExpired:
            if time.monotonic() - t0 < limit:
                left = budget_left()
                log(name, f"running {time.monotonic() - t0:.0f}s of {limit:.0f}s"
                          + ("" if left is None else f"; budget left {left:.0f}s"))
    if status == "timeout":
        log(name, f"time limit {limit:.0f}s reached: stopping it")
        for sig, grace in ((signal.SIGINT, 5), (signal.SIGTERM, 3), (signal.SIGKILL, 2)):
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
    res = {"status": status, "exit": rc, "seconds": round(secs, 1), "rows": found, "tail": tail[-15:]}
    if name in BENCHMARKS:
        res.update(benchmark_status(status, found))
    left = budget_left()
    log(name, f"{res['status']} (exit {rc}) after {secs:.1f}s" + ("" if left is None else f"; budget left {left:.0f}s"))
    return res


def benchmark_status(status: str, found: list[dict]) -> dict:
    """A benchmark part whose time ran out after it measured rows is `partial`, not a failure: the rows
    it has stand on their own. Out of time with nothing measured stays `timeout`; a failed row stays
    `failed` (the part's exit status)."""
    measured = sum(1 for r in found if "tokens_per_s" in r)
    cut = sum(1 for r in found if r.get(rows.CUT))
    if status == "timeout" and measured:
        return {"status": "partial", "reason": f"stopped at its time limit after {measured} measured rows"}
    if status == "ok" and cut:
        return {"status": "partial", "reason": f"{measured} rows measured, {cut} not run: out of time"}
    return {}


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


def schedule(parts: list[str], limits: dict) -> dict:
    """Each part's end, in seconds from the start: the sum of the limits of the parts up to it."""
    out, end = {}, 0.0
    for name in parts:
        end += limits[name]
        out[name] = end
    return out


def orchestrate(args) -> int:
    out = Path(args.out or os.environ.get("OUT") or REPO / "gpu_report").resolve()
    out.mkdir(parents=True, exist_ok=True)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        print(f"gpu_report: --parts: unknown part {bad[0]!r}; valid: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    smoke = args.cpu_smoke or args.rehearse
    limits = parse_limits(args.limit, SMOKE_LIMITS if smoke else GPU_LIMITS)
    caps = parse_limits(args.limit, {})  # a limit given with --limit is a hard cap: no time passed on to it
    budget = args.budget if args.budget is not None else (sum(limits[p] for p in parts) if smoke else GPU_BUDGET)
    ends = schedule(parts, limits)
    log = Log(out / "gpu_check.log")
    work = Path(tempfile.mkdtemp(prefix="gpu_report_"))
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.pathsep.join(
                   [str(REPO), args.site] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE / "inductor"))
    env.setdefault("TRITON_CACHE_DIR", str(CACHE / "triton"))
    env.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    env.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    start, t0 = datetime.datetime.now(datetime.timezone.utc), time.monotonic()

    def budget_left() -> float:
        return budget - (time.monotonic() - t0)

    report = {"started": start.strftime("%Y-%m-%d %H:%M:%S"), "smoke": bool(smoke), "budget_s": budget,
              "peak_tflops": args.peak_tflops, "argv": sys.argv[1:], "parts": {}, "elapsed_s": 0.0,
              "inductor_cache": env["TORCHINDUCTOR_CACHE_DIR"]}
    if args.rehearse:
        report["rehearsal"] = {"python": sys.version.split()[0], "emulated_python": bool(args.emulated_python)}
    report["cuda"] = probe_cuda(env)
    log("cuda", json.dumps(report["cuda"]))
    py = sys.executable
    me = str(ENTRY)
    common = ["--smoke"] if smoke else []
    log("budget", f"{budget:.0f}s for {', '.join(f'{p} {limits[p]:.0f}s' for p in parts)}; "
                  f"inductor cache {env['TORCHINDUCTOR_CACHE_DIR']} ({_size_mib(env['TORCHINDUCTOR_CACHE_DIR'])})")

    def write():
        report["elapsed_s"] = round(time.monotonic() - t0, 1)
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "report.md").write_text(markdown(report))

    for name in parts:
        now = time.monotonic() - t0
        limit = max(0.0, min(ends[name] - now, budget - now - GRACE, caps.get(name, float("inf"))))
        if name == "install":
            rep = work / "install.json"
            cmd = [py, str(REPO / "scripts" / "install_wheels.py"), "--wheels", args.wheels, "--target", args.site,
                   "--report", str(rep)] + (["--skip-incompatible"] if args.cpu_smoke and not args.rehearse else [])
            res = run_part(name, cmd, limit, env, log, budget_left)
            if rep.is_file():
                report["install"] = json.loads(rep.read_text())
        elif name == "tests":
            junit = out / "tests.xml"
            junit.unlink(missing_ok=True)
            cmd = [py, me, "--part", "tests", "--junit", str(junit), "--workers", str(args.workers)] + common + (
                ["--rehearse"] if args.rehearse else []) + ["--deadline-at"]
            res = run_part(name, cmd, limit, env, log, budget_left)
            report["tests"] = {**junit_summary(junit), "selection": selection(args.cpu_smoke and not args.rehearse)}
        else:
            cmd = [py, me, "--part", name, "--peak-tflops", str(args.peak_tflops), "--workdir", str(work)] + common + [
                "--deadline-at"]
            res = run_part(name, cmd, limit, env, log, budget_left)
            if name == "env" and res["rows"]:
                report["env"] = res["rows"][-1]  # the fullest one the part got to print
        res["limit_s"] = round(limit, 1)
        if name == "env":
            res["rows"] = []
        report["parts"][name] = res
        write()
    report["verdict"] = verdict(report)
    if args.rehearse:
        report["rehearsal"]["verdict"] = rehearsal_verdict(report)
    log("budget", f"done in {time.monotonic() - t0:.0f}s of {budget:.0f}s; inductor cache "
                  f"{_size_mib(env['TORCHINDUCTOR_CACHE_DIR'])}")
    write()
    log("report", f"wrote {out / 'report.json'} and {out / 'report.md'}")
    print(markdown(report))
    for reason in report["verdict"]:
        log("verdict", f"FAILED: {reason}")
    again = rerun_parts(report)
    if again and not smoke:
        log("verdict", f"to rerun what failed (warm kernel cache): bash scripts/gpu_check.sh --parts {','.join(again)}")
    if args.rehearse:
        for reason in report["rehearsal"]["verdict"]:
            log("rehearsal", f"FAILED: {reason}")
        log("rehearsal", "passed" if not report["rehearsal"]["verdict"] else "FAILED")
        return 1 if report["rehearsal"]["verdict"] else 0
    return 1 if report["verdict"] else 0


def rerun_parts(report: dict) -> list[str]:
    """The parts to run again: those that did not end ok or partial, after `install` (a fresh machine
    needs it first; on a warm one it finds everything present and takes a second)."""
    failed = [name for name, part in report["parts"].items() if part["status"] not in ("ok", "partial")]
    if report.get("verdict") and "tests" in report["parts"] and "tests" not in failed and any(
            "gpu tests" in reason for reason in report["verdict"]):
        failed.append("tests")
    return ["install"] + [p for p in PARTS if p in failed and p != "install"] if failed else []


def _size_mib(folder: str) -> str:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return f"{total / 2**20:.1f} MiB"
