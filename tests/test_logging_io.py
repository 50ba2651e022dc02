"""Logging that cannot hang (wandb probe), metrics.jsonl after a resume, the rank-aware logger and the
atomic-write helper."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from common.io import atomic_save, atomic_write_json, atomic_write_text
from helpers import REPO, cli_env
from pretrain.logger import resolve_wandb_mode, truncate_metrics

UNRESOLVABLE = "http://wandb.invalid"  # the .invalid TLD never resolves (an offline node's DNS failure)


@pytest.fixture
def silent_server():
    """A TCP server that accepts connections and never answers (a firewall or proxy that swallows them)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def _offline_env(monkeypatch, url):
    for k in ("WANDB_MODE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NO_PROXY", "*")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", url)


@pytest.mark.parametrize("where", ["unresolvable", "silent"])
def test_wandb_auto_with_a_key_and_an_unreachable_server_goes_offline_quickly(monkeypatch, silent_server, where):
    url = UNRESOLVABLE if where == "unresolvable" else silent_server
    _offline_env(monkeypatch, url)
    for requested in ("auto", "online"):
        t0 = time.monotonic()
        mode, notice = resolve_wandb_mode(requested)
        assert time.monotonic() - t0 < 5
        assert mode == "offline" and "unreachable" in notice and url.split("//")[1] in notice


def test_wandb_auto_goes_online_when_the_server_answers(monkeypatch):
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _offline_env(monkeypatch, f"http://127.0.0.1:{server.server_port}")
        assert resolve_wandb_mode("auto") == ("online", None)
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.delenv("WANDB_API_KEY")
    assert resolve_wandb_mode("auto") == ("offline", None)  # no key: offline without probing
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode("auto") == ("disabled", None)


@pytest.mark.slow
def test_metrics_logger_with_wandb_auto_on_an_offline_node_starts_offline(tmp_path, monkeypatch):
    """The whole MetricsLogger start-up (probe + an offline wandb run) finishes in seconds, not ~100 s."""
    pytest.importorskip("wandb")
    from helpers import TINY_RECIPE
    from pretrain.config import from_dict
    from pretrain.logger import MetricsLogger

    cfg = from_dict({**TINY_RECIPE, "logging": {"wandb": "auto", "progress": False}})
    _offline_env(monkeypatch, UNRESOLVABLE)
    monkeypatch.setenv("WANDB_SILENT", "true")
    t0 = time.monotonic()
    logger = MetricsLogger(tmp_path, cfg, enabled=True, total_steps=2, start_step=0, wandb_id=None)
    logger.log(1, {"train/loss": 1.0})
    logger.close()
    assert time.monotonic() - t0 < 60
    assert (tmp_path / "wandb").is_dir()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1


def test_truncate_metrics_keeps_the_rows_the_checkpoint_covers(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "train/loss": 1.0 / (s + 1)} for s in range(7)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "train/lo')  # cut by a kill
    assert truncate_metrics(path, 4) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3, 4]
    assert truncate_metrics(path, 4) == 0
    assert truncate_metrics(path, 0) == 5 and path.read_text() == ""  # a fresh start logs step 0 again


def test_atomic_writes_replace_whole_files_and_leave_no_temp_on_failure(tmp_path):
    target = tmp_path / "a.json"
    atomic_write_json(target, {"x": 1})
    atomic_write_text(target, "new\n")
    assert target.read_text() == "new\n"

    def fail(f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_save(target, fail)
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_rank_aware_logger_prints_rank_zero_only_unless_asked():
    code = (
        "from common.log import get_logger, ALL_RANKS\n"
        "log = get_logger('setdlm.test')\n"
        "log.info('plain line')\n"
        "log.info('everyone', extra=ALL_RANKS)\n"
        "log.warning('bad thing')\n"
    )
    out = {}
    for rank in (0, 1):
        env = {**cli_env(), "RANK": str(rank), "WORLD_SIZE": "2"}
        r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out[rank] = (r.stdout, r.stderr)
    assert out[0][0].splitlines() == ["plain line", "everyone"] and out[0][1].strip() == "bad thing"
    assert out[1][0].splitlines() == ["[rank 1] everyone"] and out[1][1].strip() == "[rank 1] bad thing"


def test_no_hand_written_temp_and_rename_outside_common_io():
    """One atomic-write helper: other modules call common/io.py instead of writing tmp files themselves."""
    offenders = []
    for pkg in ("data_pipeline", "model", "pretrain", "eval", "launch"):
        for path in (REPO / pkg).rglob("*.py"):
            text = path.read_text()
            publishes_checkpoints = path.relative_to(REPO).as_posix() == "pretrain/checkpoint/save.py"
            if "os.replace(" in text and ".tmp" in text and not publishes_checkpoints:
                offenders.append(str(path.relative_to(REPO)))
    assert offenders in ([], ["pretrain/convert/staging.py"]), offenders  # staging swaps whole directories


def test_env_rank_never_raises():
    from common.env import env_rank

    assert env_rank({"RANK": "3", "WORLD_SIZE": "4"}) == 3
    assert env_rank({"RANK": "x", "WORLD_SIZE": "4"}) == 0
    assert env_rank({}) == 0
    assert os.environ.get("SETDLM_TEST_SENTINEL") is None


def test_common_imports_nothing_else_of_setdlm():
    """common/ is the lowest layer: data_pipeline, model, pretrain, eval and launch may all import it."""
    import ast

    ours = {"data_pipeline", "model", "pretrain", "eval", "launch"}
    for path in (REPO / "common").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not [n for n in names if n.split(".")[0] in ours], (path.name, names)
