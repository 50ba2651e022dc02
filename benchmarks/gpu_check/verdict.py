"""The check's exit status: it passes only when it tested something (standard library only).

It passes when every part that ran ended `ok` (a benchmark part may end `partial`: rows measured, then
out of time), no `gpu` test failed or errored, CUDA was visible (a fresh process's
`torch.cuda.is_available()`), and, when the tests part ran, every expected `gpu` test of the files it
ran did run: a skip counts as not run, except the skips ALLOWED_SKIPS names.

`rehearsal_verdict` judges `scripts/gpu_check.sh --rehearse` (the CPU smoke in a venv built like the GPU
image): there no CUDA is expected, and what must hold is that every part ended ok or partial (the
install took the carried wheels, the stack imported) and every expected `gpu` test was collected and
skipped only for want of CUDA.
"""

from __future__ import annotations

# The `gpu` tests of each file, as `pytest -m gpu` collects them. tests/test_gpu_report.py checks this
# table against a real collection: adding or removing a gpu test means updating it here.
GPU_TESTS = {
    "tests/test_gpu_compile.py": 4,
    "tests/test_gpu_context_parallel.py": 4,
    "tests/test_gpu_decode.py": 14,
    "tests/test_gpu_flex.py": 13,
    "tests/test_gpu_train.py": 7,
    "tests/test_gpu_zero3_init.py": 1,
    "tests/test_sampling_compiled.py": 3,
}
# Skips that do not fail the check: (test id, words of the skip reason). Transformer Engine is not on
# the GPU image and too large to carry (docs/gpu.md), so the FP8 test names it and skips.
ALLOWED_SKIPS = (
    ("tests.test_gpu_train::test_fp8_forward_backward_tracks_bf16", "Transformer Engine is not installed"),
)
OK = ("ok", "partial")  # `partial` only for the benchmark parts (orchestrate.benchmark_status)
NO_CUDA_SKIP = "needs a CUDA GPU"  # the words of every gpu test's skip where no GPU is visible


def expected_tests(selection: list[str]) -> int:
    """How many `gpu` tests `pytest -m gpu SELECTION` must run (SELECTION: files or folders)."""
    return sum(n for f, n in GPU_TESTS.items() if any(f == s or f.startswith(s.rstrip("/") + "/") for s in selection))


def allowed(case: dict) -> bool:
    return any(case["test"] == test and words in case.get("reason", "") for test, words in ALLOWED_SKIPS)


def verdict(report: dict) -> list[str]:
    """Why the check failed; [] when it passed."""
    why = _part_failures(report)
    cuda = report.get("cuda") or {}
    if not cuda.get("visible"):
        why.append(f"CUDA is not visible ({cuda.get('detail') or 'torch.cuda.is_available() is False'})")
    t = _junit(report, why)
    if t is None:
        return why
    if t["failed"] or t["errors"]:
        why.append(f"gpu tests: {t['failed']} failed, {t['errors']} errors")
    expected = expected_tests(t.get("selection", []))
    ran = t["passed"] + t["failed"] + t["errors"]
    skipped = [c for c in t.get("cases", []) if c["outcome"] == "skipped"]
    excused = [c for c in skipped if allowed(c)]
    if ran + len(excused) < expected:
        reasons = sorted({c.get("reason", "") for c in skipped if not allowed(c)})
        why.append(f"only {ran} of {expected} gpu tests ran" + (f" ({len(excused)} skips allowed)" if excused else "")
                   + (f"; skipped: {'; '.join(reasons)}" if reasons else ""))
    return why


def _junit(report: dict, why: list[str]) -> dict | None:
    """The tests part's JUnit summary; None when there is none to judge (`why` says so if it is missing)."""
    if "tests" not in report["parts"]:
        return None
    t = report.get("tests") or {}
    if not t.get("found"):
        why.append("the tests part wrote no JUnit file")
        return None
    return t


def _part_failures(report: dict) -> list[str]:
    return [f"part {name}: {part['status']}" + (f" ({part['reason']})" if part.get("reason") else "")
            for name, part in report["parts"].items() if part["status"] not in OK]


def rehearsal_verdict(report: dict) -> list[str]:
    """Why the rehearsal failed; [] when the check would get through on the image (CUDA aside)."""
    why = _part_failures(report)
    inst = report.get("install") or {}
    if inst.get("skipped"):
        why.append(f"install: {len(inst['skipped'])} carried wheels do not fit this Python: {inst['skipped'][0]}")
    t = _junit(report, why)
    if t is None:
        return why
    if t["failed"] or t["errors"]:
        why.append(f"gpu tests: {t['failed']} failed, {t['errors']} errors: "
                   + "; ".join(f"{f['test']}: {f['message']}" for f in t["failures"][:3]))
    expected = expected_tests(t.get("selection", []))
    collected = t["passed"] + t["failed"] + t["errors"] + t["skipped"]
    if collected != expected:
        why.append(f"{collected} gpu tests collected, {expected} expected (verdict.GPU_TESTS)")
    other = sorted({c.get("reason", "") for c in t.get("cases", []) if c["outcome"] == "skipped"
                    and NO_CUDA_SKIP not in c.get("reason", "") and not allowed(c)})
    if other:
        why.append("gpu tests skipped for another reason than no CUDA: " + "; ".join(other))
    return why
