"""model/ needs torch alone: with megatron-core, DeepSpeed and Transformer Engine unimportable, a
process imports the model, builds a TP=1 Transformer, saves its state dict, loads it weights-only into
a fresh model and decodes with model.sampling; and no code in model/ names those runtimes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers import REPO, cli_env

BLOCKED = ("megatron", "megatron.core", "deepspeed", "transformer_engine")

SCRIPT = r"""
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # `import name` raises ImportError from here on

import torch

from model.config import ModelConfig
from model.sampling import SamplingConfig, generate
from model.transformer import Transformer, full_logits

cfg = ModelConfig(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, norm="rmsnorm", activation="swiglu",
                  qk_norm=True, bias=False, tie_embeddings=False, vocab_size=100, mask_id=99, dropout=0.0, max_seq_len=64,
                  init_std=0.5)
torch.manual_seed(0)
model = Transformer(cfg)
torch.save(model.state_dict(), sys.argv[1])
torch.manual_seed(1)
fresh = Transformer(cfg).eval()
before = {{k: v.clone() for k, v in fresh.state_dict().items() if torch.is_tensor(v)}}
fresh.load_state_dict(torch.load(sys.argv[1], weights_only=True))
saved = {{k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}}
assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
assert any(not torch.equal(before[k], v) for k, v in saved.items())  # the load changed the weights

ids = torch.tensor([[5, 6, 7, 8]])
with torch.no_grad():
    a = full_logits(model.eval(), model(ids, torch.arange(4)[None], torch.ones(4, 4, dtype=torch.bool)))
    b = full_logits(fresh, fresh(ids, torch.arange(4)[None], torch.ones(4, 4, dtype=torch.bool)))
assert a.shape == (1, 4, 100) and torch.equal(a, b)
for family in ("setdlm", "ar"):
    sc = SamplingConfig(family=family, max_new_tokens=6, window=2)
    out = generate(fresh, [[5, 6, 7, 8]], sc)
    assert out[0].tokens == generate(model, [[5, 6, 7, 8]], sc)[0].tokens
    assert 0 < len(out[0].tokens) <= 6 and all(0 <= t < 99 for t in out[0].tokens), out[0].tokens
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r} and sys.modules[m] is not None)
assert not loaded, loaded
print("decoded", out[0].tokens)
"""


@pytest.mark.slow
def test_model_builds_loads_and_decodes_without_megatron_or_deepspeed(tmp_path):
    script = tmp_path / "standalone.py"
    script.write_text(SCRIPT.format(blocked=BLOCKED))
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "state.pt")], cwd=REPO, env=cli_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "decoded" in r.stdout


def test_no_code_in_model_names_a_parallel_runtime():
    """grep -rn "ds_tensor\\|ds_process_group\\|deepspeed\\|megatron" model/ finds nothing (code,
    comments and docstrings alike)."""
    pattern = re.compile(r"ds_tensor|ds_process_group|deepspeed|megatron|transformer_engine", re.IGNORECASE)
    hits = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
            for path in sorted((REPO / "model").rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)
