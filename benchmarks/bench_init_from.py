"""Import time and peak host memory of `train.init_from` for a Hugging Face model of the Qwen3-1.7B shape.

    python benchmarks/bench_init_from.py [--dir /tmp/qwen3-1.7b-random] [--tp 1 2] [--layers 28]

Writes (once) a random model of the Qwen3-1.7B shape (28 layers, hidden 2048, 16 heads / 8 KV heads,
head_dim 128, SwiGLU 6144, vocabulary 151,936, tied) as sharded bf16 safetensors with config.json
and the Qwen tokenizer, then for each TP size launches that many processes which run the trainer's
path (`init_from.prepare`, `build_stage`, `build_engine`, `init_from.load`) and prints a table: the
time to build the randomly initialised stage, the time to load the weights into it, and the peak
resident memory per rank (ru_maxrss) after building and after loading. The weights are read one tensor at a time (hf_stock.HFWeights),
so the load adds about one full tensor (the 1.2 GB fp32 embedding) to the model shard itself.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPE = dict(n_layers=28, hidden=2048, heads=16, kv=8, head_dim=128, ffn=6144, rows=151936)


def write_model(d: Path, layers: int) -> None:
    import torch
    from safetensors.torch import save_file

    from data_pipeline.tokenizers import load_tokenizer

    s = SHAPE
    d.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": s["hidden"],
              "intermediate_size": s["ffn"], "num_hidden_layers": layers, "num_attention_heads": s["heads"],
              "num_key_value_heads": s["kv"], "head_dim": s["head_dim"], "vocab_size": s["rows"],
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
              "rope_parameters": {"rope_theta": 1_000_000.0, "rope_type": "default"}, "hidden_act": "silu",
              "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151643, "dtype": "bfloat16"}
    (d / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    H, D, F = s["hidden"], s["head_dim"], s["ffn"]
    shards, weight_map = [{"model.embed_tokens.weight": rnd(s["rows"], H), "model.norm.weight": torch.ones(H).bfloat16()}], {}
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append({p + "self_attn.q_proj.weight": rnd(s["heads"] * D, H), p + "self_attn.k_proj.weight": rnd(s["kv"] * D, H),
                       p + "self_attn.v_proj.weight": rnd(s["kv"] * D, H), p + "self_attn.o_proj.weight": rnd(H, s["heads"] * D),
                       p + "self_attn.q_norm.weight": torch.ones(D).bfloat16(), p + "self_attn.k_norm.weight": torch.ones(D).bfloat16(),
                       p + "mlp.gate_proj.weight": rnd(F, H), p + "mlp.up_proj.weight": rnd(F, H), p + "mlp.down_proj.weight": rnd(H, F),
                       p + "input_layernorm.weight": torch.ones(H).bfloat16(),
                       p + "post_attention_layernorm.weight": torch.ones(H).bfloat16()})
    n = len(shards)
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(d / name), metadata={"format": "pt"})
        weight_map.update({t: name for t in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    load_tokenizer("qwen3").save(d)  # the Qwen3 vocabulary (with <|mask|>) as tokenizer.json


def worker(d: str, tp: int, out: str) -> None:
    import torch.distributed as dist

    from data_pipeline.tokenizers import load_tokenizer
    from pretrain.parallel import ensure_model_parallel, ensure_process_group
    from pretrain import init_from
    from pretrain.config import from_dict
    from pretrain.engine import _skip_cpu_shm_op, build_engine
    from pretrain.parallelize import build_stage

    ensure_process_group()
    _skip_cpu_shm_op()
    t0 = time.perf_counter()
    cfg = from_dict({"run": {"out_dir": "/tmp", "name": f"bench-init-from-tp{tp}"}, "data": {"seq_len": 1024},
                     "train": {"init_from": d, "micro_batch": 1, "global_batch": 1}, "parallel": {"tp": tp},
                     "logging": {"wandb": "disabled"}})
    source = init_from.prepare(cfg)
    cfg.resolve_vocab(load_tokenizer(cfg.data.tokenizer, add_mask=cfg.data.add_mask_token))
    cfg.validate(dist.get_world_size())
    ensure_model_parallel(tp, 1)
    t1 = time.perf_counter()
    model = build_stage(cfg.model, tp, 1)
    engine, _, _ = build_engine(model, cfg, dist.get_world_size(), "fp32")
    t2 = time.perf_counter()
    rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    init_from.load(engine, source, cfg.model)
    t3 = time.perf_counter()
    shard_gb = sum(p.numel() * p.element_size() for p in engine.module.parameters()) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB -> GB (approx.)
    row = {"rank": dist.get_rank(), "prepare_s": t1 - t0, "build_s": t2 - t1, "load_s": t3 - t2,
           "shard_gb": shard_gb, "built_rss_gb": rss_built, "peak_rss_gb": rss}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/qwen3-1.7b-random")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--layers", type=int, default=SHAPE["n_layers"])
    p.add_argument("--worker", nargs=3, metavar=("DIR", "TP", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker[0], int(a.worker[1]), a.worker[2])
        return 0
    d = Path(a.dir)
    if not (d / "config.json").is_file():
        t = time.perf_counter()
        write_model(d, a.layers)
        print(f"wrote a random Qwen3-1.7B-shape model ({a.layers} layers, bf16 safetensors) to {d} in "
              f"{time.perf_counter() - t:.0f} s")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    print(f"{'tp':>3} {'rank':>4} {'prepare s':>9} {'build s':>8} {'load s':>7} {'shard GB':>8} {'RSS built GB':>12} "
          f"{'peak RSS GB':>11}")
    for tp in a.tp:
        out = d / f"bench-tp{tp}.json"
        me = [str(Path(__file__).resolve()), "--worker", str(d), str(tp), str(out)]
        cmd = [sys.executable, *me] if tp == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc-per-node={tp}", *me]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode:
            print(f"tp={tp}: failed\n{(r.stdout + r.stderr)[-3000:]}")
            continue
        for row in json.loads(out.read_text()):
            print(f"{tp:>3} {row['rank']:>4} {row['prepare_s']:>9.1f} {row['build_s']:>8.1f} {row['load_s']:>7.1f} "
                  f"{row['shard_gb']:>8.2f} {row['built_rss_gb']:>12.2f} {row['peak_rss_gb']:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
