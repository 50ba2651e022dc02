"""The training loop: build everything, resume if a checkpoint exists, train, validate, save."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from .mcore import parallel_state

from common.errors import Error
from common.storage import check_output_dir, tree_bytes
from data_pipeline.loader import build_loader
from data_pipeline.reader import fill_rows
from data_pipeline.tokenizer import META_FILE as TOKENIZER_META
from data_pipeline.tokenizers import load_tokenizer
from model.noise import TRAIN, SampleNoise
from model.objectives import build_objective
from model.shapes import parameter_count

from . import fp8, init_from
from .checkpoint import resume, rng, rundir, versions
from .checkpoint.best import BestCheckpoint
from .checkpoint.save import check_space, clean_partial, estimate_bytes, expected_bytes
from .checkpoint.writer import Saver
from .config import RecipeConfig, save_config
from .ema import EMA
from .engine import build_engine, resolve_precision, zero3_init, zero3_notes
from .flops import device_peak_tflops, step_flops
from .logger import MetricsLogger
from .parallel import (cp_size, data_group, data_rank, data_size, ensure_model_parallel, ensure_process_group,
                       replica_group, replica_rank, replica_size)
from .parallelize import build_stage, prepare_model
from .pipeline import StepRunner, add_metrics
from .preemption import active_handler, release_handler
from .validation import Validation



class Trainer:
    def __init__(self, cfg: RecipeConfig):
        self.cfg = cfg
        self.preemption = active_handler()  # signals during set-up are kept and honoured at the first step
        ensure_process_group()
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.init_source = init_from.prepare(cfg)  # train.init_from: architecture + tokenizer from the source
        self.tokenizer = load_tokenizer(cfg.data.tokenizer, add_mask=cfg.data.add_mask_token)
        cfg.resolve_vocab(self.tokenizer)
        cfg.validate(self.world)
        fp8.check_available(cfg.model.fp8)  # Transformer Engine + an FP8 GPU, or a clear error now
        p = cfg.parallel
        ensure_model_parallel(p.tp, p.pp, p.cp)
        self.dp_rank, self.dp_size = data_rank(), data_size()  # the loader's axis (CP peers read the same samples)
        self.mp_rank = parallel_state.get_model_parallel_group().rank()
        self.dp_group = replica_group()  # dp x cp: the ranks that hold the same weights
        self.data_group = data_group()  # dp: one rank per CP group (what the loaders read is summed over it)
        self.replica_rank, self.replica_size = replica_rank(), replica_size()
        # CP peers read the same rows: rank 0 of each CP group counts them (tokens seen, validation rows)
        self.counts_rows = parallel_state.get_context_parallel_rank() == 0
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
        self.run_dir = cfg.run_dir
        self.ckpt_root = rundir.checkpoints_dir(self.run_dir)

        torch.manual_seed(cfg.run.seed)
        self.precision = resolve_precision(cfg, self.device)
        self.ckpt_bytes = self.check_outputs()  # before any work: writable, inside the run, room for a checkpoint
        # format-2 checkpoints, written in the background (train.async_save; pretrain/checkpoint/writer.py)
        self.saver = Saver(self.ckpt_root, rank=self.rank, background=cfg.train.async_save, keep_last=cfg.train.keep_last,
                           need=self.ckpt_bytes)
        self._lines: list[str] = []  # log lines from the writer thread (rank 0), printed at the next step
        # ZeRO-3: built inside deepspeed.zero.Init, each rank holding only its partition (pretrain/engine.py)
        zero_init = zero3_init(cfg, self.world, self.precision) if cfg.model.fp8 == "none" else None
        # this rank's TP shard of its PP stage, allocated and initialised on the device, then FP8,
        # activation checkpointing and torch.compile (pretrain/parallelize.py)
        model = build_stage(cfg.model, p.tp, p.pp, device=self.device, sequence_parallel=p.sequence_parallel,
                            zero_init=zero_init, lora=cfg.train.lora, cp=p.cp)
        self.notes = prepare_model(model, cfg)
        self.notes += zero3_notes(model, cfg)
        # under CP, prepare() gives this rank its part of every sequence (model/objectives/base.py for_rank)
        self.objective = build_objective(cfg.objective, cfg.model, cfg.data.seq_len, cross_entropy=model.tp.cross_entropy,
                                         context=model.cp)
        if self.precision == "bf16" and p.zero_stage == 0:
            # DeepSpeed's bf16 path without ZeRO (its unfused FP16 wrapper) drifts from fp32 after the
            # first step; its ZeRO-1 bf16 optimizer tracks fp32 (docs/architecture.md). ZeRO-1 is the
            # same data parallelism with the fp32 master weights and Adam states sharded over DP.
            p.zero_stage = 1
            self.notes.append("bf16: parallel.zero_stage 0 -> 1 (DeepSpeed's bf16 optimizer with fp32 master weights)")
        self.engine, self.optimizer, self.scheduler = build_engine(model, cfg, self.world, self.precision)
        self.model = self.engine.module
        self.stepper = StepRunner(self.engine, self.objective, cfg)  # layout-specific steps (pretrain/pipeline.py)
        self.validation = Validation(self)  # val/nll and the unigram baseline (pretrain/validation.py)
        self.ema = EMA(self.model, cfg.train.ema) if cfg.train.ema > 0 else None
        # Orders and noise are drawn per sample from (seed, its global position in the data order), so a
        # sample sees the same draws under any layout (model/noise.py, data_pipeline/order.py).
        self.train_loader = self._loader("train")
        epochs = cfg.resolve_epochs(self.train_loader.num_samples)  # train.epochs -> train.max_steps
        if epochs:
            self.notes.append(epochs)
        self.step = 0
        self.tokens_seen = 0
        self._rows = 0  # real rows this rank trained on since tokens_seen was last brought up to date
        self.wandb_id = None
        self.relayout_notes: list[str] = []

    # -- checkpoints ---------------------------------------------------------------------------
    def check_outputs(self) -> int:
        """Rank 0 checks, and every rank raises the same error, before any work: the run directory can
        be written and its checkpoints stay inside it; the temporary files of killed runs are removed;
        the disk has room for the next checkpoint (a requeued job on a full disk stops here). Returns
        the bytes a checkpoint needs."""
        found: list = [None, 0]
        if self.rank == 0:
            try:
                check_output_dir(self.run_dir, "run.out_dir (--out)")
                rundir.check_run_dir(self.run_dir)
                clean_partial(self.ckpt_root)
                estimate = estimate_bytes(parameter_count(self.cfg.model), ema=self.cfg.train.ema > 0,
                                          precision=self.precision)
                need, source = expected_bytes(self.ckpt_root, estimate)
                check_space(self.ckpt_root, need, source)
                found[1] = need
            except Error as e:
                found[0] = e
        if self.world > 1:
            dist.broadcast_object_list(found, src=0)
        if found[0] is not None:
            raise found[0]
        return found[1]

    def meta(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "wandb_id": self.logger.wandb_id,
                "layout": {"world": self.world, **self.meta_layout()},
                "tokenizer": self.tokenizer.name, "tokenizer_sha256": self.tokenizer.sha256,
                "objective": self.cfg.objective.name, "config": self.cfg.to_dict(),
                "data": self.train_loader.record()}  # per source: samples, tokens, epochs (`setdlm data inspect RUN`)

    def _count_tokens(self, window: dict | None = None) -> dict:
        """Bring tokens_seen up to date: the real rows of every rank since the last count (rows of bad
        shards skipped under data.skip_bad_shards are not seen) times seq_len. Every rank calls it at
        the same steps (it sums over the data-parallel group); `window`'s loss sums travel in the same
        reduction. Returns the reduced `window`."""
        red = self.stepper.reduce({**(window or {}), "rows": self._rows})
        self.tokens_seen += round(red.pop("rows", 0)) * self.cfg.data.seq_len
        self._rows = 0
        return red

    def save(self, *, block: bool = False, best=None) -> dict:
        """Save a checkpoint of this step (every rank): the step loop waits for the snapshot, the files are
        written in the background unless `block` (the last step, a preemption) or train.async_save is off.
        `best` (train.keep_best) records it as the best once it is published. Returns the ckpt/ metrics."""
        t0 = time.perf_counter()
        self.saver.wait()  # a write still in flight: the loop waits for it (and counts it in ckpt/blocking_s)
        finished = self._finished_writes()
        self._count_tokens()
        extra = {"rng": rng.rng_state(), "data": self.train_loader.state_dict(), "step": self.step}
        own = self.saver.save(self.engine, self.ema, self.step, meta=self.meta(), extra=extra, block=block,
                              publish_hook=self._published(best))
        stats = {**finished, **own, "ckpt/blocking_s": time.perf_counter() - t0}
        where = self.ckpt_root / rundir.tag_for(self.step)
        if "ckpt/write_s" in own:  # written before returning
            stats["ckpt/write_step"] = self.step
            self.logger.write(f"saved checkpoint {where}")
        else:
            self.logger.write(f"saving checkpoint {where.name} in the background (the step loop waited "
                              f"{stats['ckpt/blocking_s']:.2f} s)")
        return stats

    def _published(self, best):
        """What rank 0 does in the writer thread once a checkpoint is published: measure it (the next
        checkpoint's space), and record it as the best (train.keep_best)."""
        def hook(path: Path, step: int) -> None:
            self.ckpt_bytes = self.saver.need = tree_bytes(path)
            if best is not None:
                self._lines.append(best.mark(path, step))
        return hook if self.rank == 0 else None

    def _finished_writes(self) -> dict:
        """The background writes that ended since the last call: their log lines and ckpt/write_s."""
        out = {}
        for done in self.saver.take():
            self.logger.write(f"saved checkpoint {done.path} (written in the background in {done.write_s:.2f} s)")
            out = {"ckpt/write_s": done.write_s, "ckpt/write_step": done.step}
        while self._lines:
            self.logger.write(self._lines.pop(0))
        return out

    def maybe_resume(self) -> bool:
        if self.rank == 0:
            clean_partial(self.ckpt_root)
        dist.barrier()
        path = rundir.latest_checkpoint(self.ckpt_root, notes=self.notes) if self.ckpt_root.is_dir() else None
        if path is None:
            return False
        saved_meta = rundir.read_meta(path)
        resume.check_compatible(saved_meta, self.cfg, path, self.tokenizer)  # other weights or tokenizer: refused
        p = self.cfg.parallel
        kind = rundir.storage(path, saved_meta)
        same = resume.same_layout(saved_meta, p.tp, p.pp, self.dp_size, p.zero_stage, cp_size())
        if kind == "dcp":  # any layout: each rank reads the chunks it holds (pretrain/checkpoint/train_state.py)
            meta, extra, notes = resume.load_sharded(self.engine, path, ema=self.ema, rank=self.rank)
            resume.set_scheduler_step(self.scheduler, meta["step"])
            if not same:
                self.relayout_notes = [f"re-layout: {resume.describe(saved_meta['layout'])} -> {resume.describe(self.meta_layout())}, "
                                       f"read from {path} by every rank", *notes]
            else:
                self.notes += notes
        elif kind == "deepspeed" and same and not versions.weight_renames(saved_meta):
            # format 1, the same layout and the same weight names: DeepSpeed's own loader
            meta, extra, ema = resume.load(self.engine, path, rank=self.rank, mp_rank=self.mp_rank)
            if self.ema is not None and ema is not None:
                self.ema.load_state_dict(ema)
        else:  # format 1 under another layout, or an imported run: the full state, then this rank's part
            meta, extra, notes = resume.load_relayout(self.engine, path, ema=self.ema)
            resume.set_scheduler_step(self.scheduler, meta["step"])
            source = (f"{path}/{rundir.CONSOLIDATED}" if (path / rundir.CONSOLIDATED).is_file()
                      else f"{path} (format-1 shards merged in memory)")
            self.relayout_notes = [f"re-layout: {resume.describe(saved_meta['layout'])} -> this run's layout, from "
                                   f"{source}", *notes]
        self.step, self.tokens_seen, self.wandb_id = meta["step"], meta["tokens_seen"], meta.get("wandb_id")
        self.engine.global_samples = self.step * self.cfg.train.global_batch
        rng.set_rng_state(extra["rng"])
        if "data" in extra:
            self.train_loader.load_state_dict(extra["data"])
            self.notes += self.train_loader.notes  # a mixture's new schedule (other weights or global batch)
        return True

    def meta_layout(self) -> dict:
        p = self.cfg.parallel
        return {"tp": p.tp, "pp": p.pp, "dp": self.dp_size, "cp": cp_size(), "zero_stage": p.zero_stage}

    # -- evaluation (pretrain/validation.py) -----------------------------------------------------
    def validate(self) -> dict:
        return self.validation.validate()

    def _loader(self, split: str, data=None, pad_last: bool = False):
        cfg = self.cfg
        return build_loader(data or cfg.data, split=split, tokenizer=self.tokenizer, micro_batch=cfg.train.micro_batch,
                            dp_rank=self.dp_rank, dp_size=self.dp_size, seed=cfg.run.seed,
                            global_batch=cfg.train.global_batch, pad_last=pad_last)

    def _prepare(self, batch: dict, stream: int, **kw):
        """Model inputs of a micro-batch, its noise keyed by the samples' global positions. A micro-batch
        shortened (or emptied) by bad shards skipped under data.skip_bad_shards is filled up with
        weight-0 filler rows: every rank and stage runs the same shapes and collectives, and the step's
        loss and token counts are those of its real rows."""
        batch = self._to_device(fill_rows(batch, self.cfg.train.micro_batch))
        noise = SampleNoise(self.cfg.run.seed, batch["sample_index"], self.cfg.train.global_batch, stream)
        return self.objective.prepare(batch, noise, **kw)

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    # -- loop ----------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        resumed = self.maybe_resume()
        best = BestCheckpoint.from_config(t, self.ckpt_root)  # train.keep_best (continues a resumed run's best)
        if not resumed:  # train.init_from: pretrained weights (never on resume)
            self.notes += init_from.load(self.engine, self.init_source, cfg.model, self.ema)
        elif self.init_source is not None:  # what the recipe took from this run's own checkpoint
            self.notes += self.init_source.notes
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
            tok_dir = rundir.tokenizer_dir(self.run_dir)
            if not (tok_dir / TOKENIZER_META).is_file():  # absent, or cut short by a kill: (re)written
                self.tokenizer.save(tok_dir)
        self.logger = MetricsLogger(self.run_dir, cfg, enabled=self.rank == 0, total_steps=t.max_steps,
                                    start_step=self.step, wandb_id=self.wandb_id)
        n_params = parameter_count(cfg.model)
        self.logger.write(
            f"setdlm: {cfg.objective.name} | {n_params / 1e6:.1f}M params | world {self.world} "
            f"(tp {cfg.parallel.tp}, pp {cfg.parallel.pp}, " + (f"cp {cfg.parallel.cp}, " if cfg.parallel.cp > 1 else "")
            + f"dp {self.dp_size}, ZeRO-{cfg.parallel.zero_stage}) | "
            f"L={cfg.data.seq_len} global batch {t.global_batch} | run dir {self.run_dir}"
            + (f" | resumed at step {self.step}" if resumed else ""))
        handler = self.preemption
        accum = cfg.grad_accum(self.world)
        seq_tokens = t.global_batch * cfg.data.seq_len
        flops = step_flops(cfg)  # model FLOPs (allowed attention pairs) and hardware FLOPs (+ recomputation)
        peak = device_peak_tflops(t.peak_tflops)
        last, carry = {}, {}
        for note in self.notes + self.relayout_notes:
            self.logger.write(note)
        if self.relayout_notes and t.eval_every > 0:  # the loaded weights, to compare with the saved run's
            check = self.validate()
            self.logger.write(f"re-layout check: val/nll {check['val/nll']:.6f} at step {self.step} from the loaded "
                              "weights (compare the saved run's row of this step)")
            carry = {f"relayout/{k}": v for k, v in check.items()}  # on the next row: one row per step
        if not resumed and t.eval_every > 0:
            last = self.validate()
            last["val/unigram_nll"] = self.validation.unigram_nll()
            self.logger.write(f"validation unigram baseline: {last['val/unigram_nll']:.4f} nats/token")
            self.logger.log(0, last)
        train_iter = iter(self.train_loader)
        handler.end_setup()  # a signal during set-up said "stopping after set-up"; from here it stops at a step's end
        window_t, window_steps = time.perf_counter(), 0
        window_loss: dict = {}
        preempted = False
        epochs = self.train_loader.source_epochs()
        while self.step < t.max_steps:
            try:
                batches = [next(train_iter) for _ in range(accum)]
            except StopIteration:  # data.on_exhausted=stop: a mixture source ran out (at a step boundary)
                last["exhausted"] = self._end_of_data()
                break
            if self.counts_rows:
                self._rows += sum(len(b["input_ids"]) for b in batches)
            m, gnorm = self.stepper.train_step([self._prepare(b, TRAIN) for b in batches])
            add_metrics(window_loss, m)
            self.step += 1
            window_steps += 1
            if self.ema is not None:
                self.ema.update()
            self.logger.advance()
            metrics = {}
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                elapsed = time.perf_counter() - window_t
                red = self._count_tokens(window_loss)
                tps = window_steps * seq_tokens / elapsed
                metrics = {"train/loss": red["loss_sum"] / max(red["loss_count"], 1.0),
                           "train/lr": self.scheduler.get_last_lr()[0],
                           "train/grad_norm": float(gnorm) if gnorm is not None else None,
                           "train/tokens_seen": self.tokens_seen, "perf/tokens_per_s": tps,
                           "perf/step_s": elapsed / window_steps,
                           **flops.metrics(window_steps / elapsed, peak, self.world)}
                window_t, window_steps, window_loss = time.perf_counter(), 0, {}
                epochs = self._log_epochs(epochs, metrics)
            if t.eval_every > 0 and (self.step % t.eval_every == 0 or self.step == t.max_steps):
                metrics.update(self.validate())
            new_best = best is not None and best.improves(metrics)
            preempted = handler.should_stop(self.step, every=t.preemption_check_every)
            self.saver.poll(self.step, every=t.preemption_check_every)  # a finished background write (or its failure)
            metrics.update(self._finished_writes())
            if preempted or self.step % t.save_every == 0 or self.step == t.max_steps or new_best:
                # the last step and a preemption wait for the write: nothing may exit before it is published
                metrics.update(self.save(block=preempted or self.step == t.max_steps, best=best if new_best else None))
            if metrics:
                last.update(metrics)
                self.logger.log(self.step, {**carry, **metrics}, print_line="train/loss" in metrics or "val/nll" in metrics)
                carry = {}
            if preempted:
                self.logger.write(f"preemption signal received: saved at step {self.step}, exiting for requeue")
                handler.requeue()
                break
        self.saver.wait()  # a write still in flight (a run that ended on exhausted data)
        self._finished_writes()
        release_handler()
        if not preempted and t.sample_at_end and self.rank == 0:
            self.print_sample()
        if not preempted and t.export_hf and self.rank == 0:  # Hugging Face export of the final checkpoint
            from .convert.export import export_at_end

            self.logger.write(export_at_end(self.run_dir, best=t.keep_best))
        self.logger.close()
        last["preempted"] = preempted
        last["step"] = self.step
        return last

    def _log_epochs(self, before: dict, metrics: dict) -> dict:
        """A mixture (data.on_exhausted=repeat): each source's completed epochs in the row, a line when one grows."""
        now = self.train_loader.source_epochs()
        for name, e in now.items():
            metrics[f"data/epochs/{name}"] = e
            if e > before.get(name, 0):
                self.logger.write(f"data.mixture: source {name!r} read whole {e} time{'s' if e > 1 else ''} by step "
                                  f"{self.step}; it repeats (data.on_exhausted=repeat), reshuffled")
        return now

    def _end_of_data(self) -> str:
        """data.on_exhausted=stop: say which source ran out, save, and let the run end cleanly."""
        name = self.train_loader.exhausted
        rec = self.train_loader.record()["sources"].get(name, {})
        self.logger.write(f"data.mixture: source {name!r} ran out (its {rec.get('train_samples')} train samples read, "
                          f"data.on_exhausted=stop): the run ends at step {self.step}")
        if self.step and self.step % self.cfg.train.save_every:
            self.save(block=True)
        return name

    def print_sample(self) -> None:
        from model.sampling import SamplingConfig
        from model.sampling.report import speed_report

        p = self.cfg.parallel
        if p.tp * p.pp > 1 or (p.zero_stage == 3 and self.replica_size > 1):  # rank 0 alone holds no whole model
            self.logger.write("train.sample_at_end: skipped, the weights are sharded under this layout; "
                              f"sample the checkpoint instead (setdlm sample --checkpoint {self.run_dir})")
            return
        t, o = self.cfg.train, self.cfg.objective
        sc = SamplingConfig.from_objective(o, max_new_tokens=t.sample_tokens, temperature=t.sample_temperature,
                                           top_p=t.sample_top_p, threshold=t.sample_threshold or None,
                                           seed=self.cfg.run.seed, repetition_penalty=t.sample_repetition_penalty)
        self.logger.write(speed_report(self.model, self.tokenizer, t.sample_prompt or "", sc, mask_id=self.cfg.model.mask_id))


def train(cfg: RecipeConfig) -> dict:
    trainer = Trainer(cfg)
    return trainer.train()


