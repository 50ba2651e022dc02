"""The plan's communication count (pretrain/comm.py) against what the collectives of real gloo runs move.

The 2- and 4-process parity runs (tests/test_parallel_parity.py, the session fixture `parity_runs`)
count every collective of every rank in one training step (tests/comm_counter.py) and write it with
the rank's groups and recipe. For each rank, the payload the plan predicts per axis and collective (TP
all-reduces, TP + SP all-gathers and reduce-scatters with the backward re-gather, full recomputation's
second forward, PP sends and the tied embedding's all-reduce, ZeRO-0/1/2/3's reductions and gathers,
bf16 and fp32) must equal the counted payload up to the step's scalar reductions (loss and token sums,
gradient norms: at most SLACK bytes per group), and so must the bytes per rank under ring algorithms
(what the dry run prints and times). Context parallelism is checked the same way on the CP runtime's
own cases that the parity launch runs where that runtime exists (test_parallel_parity.CP_COUNTED);
without it that test skips, saying so.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from pathlib import Path

import pytest

from comm_counter import ring_bytes
from pretrain.comm import step_collectives
from pretrain.config import from_dict

pytestmark = pytest.mark.slow

SLACK = 1024  # bytes per group and collective kind: the step's scalar all-reduces (float64 norms, counts, flags)


def labels(groups: dict) -> dict:
    """axis -> its name in the comparison: axes whose groups are the same ranks (the replica group and the
    CP group when dp = 1) share one name, since a collective on those ranks belongs to either."""
    return {axis: "+".join(sorted(a for a, g in groups.items() if g == ranks and a != "embedding"))
            for axis, ranks in groups.items() if axis != "embedding"}


def counted(path: Path) -> tuple[dict, dict, dict]:
    """(the rank's record, {(axis, op): payload}, {axis: ring bytes sent}) of one comm file."""
    d = json.loads(path.read_text())
    name = labels({k: v for k, v in d["groups"].items() if len(v) > 1})
    by_ranks = {tuple(d["groups"][axis]): label for axis, label in name.items()}
    emb = tuple(d["groups"].get("embedding", ()))
    payload, sent = defaultdict(float), defaultdict(float)
    for op, ranks, nbytes, _dtype, n in d["calls"]:
        ranks = tuple(ranks)
        if op == "recv":  # the sender counts it
            continue
        axis = name.get("pp", "pp") if op == "send" else by_ranks.get(ranks, f"group {list(ranks)}")
        if op == "all_reduce" and ranks == emb:
            axis = "embedding"
        payload[(axis, op)] += nbytes * n
        sent[axis] += ring_bytes(op, len(ranks), nbytes) * n
    return d, payload, sent


def planned(d: dict) -> tuple[dict, dict]:
    payload, sent = _planned(json.dumps(d["recipe"], sort_keys=True), d["world"], d["stage"])
    name = labels({k: v for k, v in d["groups"].items() if len(v) > 1})
    rename = lambda axis: name.get(axis, axis)  # noqa: E731
    out_payload, out_sent = defaultdict(float), defaultdict(float)
    for (axis, op), v in payload.items():
        out_payload[(rename(axis), op)] += v
    for axis, v in sent.items():
        out_sent[rename(axis)] += v
    return out_payload, out_sent


@functools.lru_cache(maxsize=None)  # the ranks of one stage of one run share it
def _planned(recipe: str, world: int, stage: int) -> tuple[dict, dict]:
    cfg = from_dict(json.loads(recipe))
    precision = cfg.train.precision if cfg.train.precision != "auto" else "fp32"
    plan = step_collectives(cfg, world, precision, stage=stage)
    payload, sent = defaultdict(float), defaultdict(float)
    for c in plan:
        payload[(c.axis, c.op)] += c.payload
        sent[c.axis] += c.sent
    return dict(payload), dict(sent)


def compare(path: Path) -> list[str]:
    d, got, got_sent = counted(path)
    want, want_sent = planned(d)
    bad = []
    for key in sorted(set(got) | set(want)):
        g, w = got.get(key, 0.0), want.get(key, 0.0)
        if not w <= g <= w + SLACK:
            bad.append(f"{path.name} {key}: counted {g:,.0f} bytes, planned {w:,.0f}")
    for axis in sorted(set(got_sent) | set(want_sent)):
        g, w = got_sent.get(axis, 0.0), want_sent.get(axis, 0.0)
        if not w - 1e-6 <= g <= w + 2 * SLACK:
            bad.append(f"{path.name} {axis}: {g:,.0f} bytes sent per rank, planned {w:,.0f}")
    return bad


def comm_files(out: Path, *, cp: bool) -> list[Path]:
    """The comm files of the runs with (`cp`) or without a context-parallel group."""
    files = sorted(out.glob("*.comm*.json"))
    return [f for f in files if (len(json.loads(f.read_text())["groups"]["cp"]) > 1) == cp]


def test_the_plan_counts_what_gloo_moves(parity_runs):
    files = comm_files(parity_runs, cp=False)
    names = {f.name.split(".comm")[0] for f in files}
    # every axis and ZeRO stage is among them: TP, TP + SP, full recomputation, PP (tied and untied), ZeRO 0-3
    for name in ("qwen-tp2pp1z0", "qwen_sp-tp2pp1z0", "qwen_full-tp2pp1z0", "gpt-tp2pp2z0", "qwen-tp1pp2z1",
                 "qwen-tp1pp1z2", "qwen-tp1pp1z3", "qwen_z3wide-tp1pp1z3", "qwen_bf16-tp2pp1z0", "qwen-tp2pp1z2"):
        assert name in names, (name, sorted(names))
    bad = [line for f in files for line in compare(f)]
    assert not bad, "\n".join(bad)


def test_context_parallel_exchange_is_what_the_plan_counts(parity_runs):
    files = comm_files(parity_runs, cp=True)
    if not files:
        pytest.skip("no context-parallel run among the parity runs: the CP runtime (model/context_parallel.py) is "
                    "not here; where it is, its cases join the 4-process parity launch (CP_COUNTED)")
    bad = [line for f in files for line in compare(f)]
    assert not bad, "\n".join(bad)
