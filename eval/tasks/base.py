"""What every task shares: its typed options, the checkpoint, units of examples, speed metrics."""

from __future__ import annotations

from ..metrics import mean, percentile
from ..models import Checkpoint, ModelPredictor, pick_device, prompt_budget, sampling_spec
from ..options import GenerationOptions, RunOptions, sampling_config
from ..overlong import sort_overlong
from ..shard import Shard
from ..units import EvalRun, Unit, seed_for


class Task:
    name = "task"
    help = ""
    generation = False  # decodes text (speed metrics, sampling options)
    options: type = RunOptions  # the typed options (eval/options.py): flags, --describe and eval.api

    def __init__(self, args, shard: Shard, predictor=None):
        self.args, self.shard = args, shard  # args: the task's frozen typed options (`options`)
        self.seed = args.seed
        self.predictor = predictor
        self.ckpt = None
        if getattr(args, "checkpoint", None) or predictor is None:
            self.ckpt = Checkpoint(args.checkpoint, ema=not args.no_ema,
                                   device=pick_device(shard.local_rank, getattr(args, "device", None)))

    @property
    def tokenizer(self):
        if self.ckpt is not None:
            return self.ckpt.tokenizer
        return getattr(self.predictor, "tokenizer", None)

    def spec(self) -> dict:
        s = {"seed": self.seed, "limit": self.args.limit}
        if self.ckpt is not None:
            s["checkpoint"] = self.ckpt.describe()
        elif self.predictor is not None:
            s["predictor"] = getattr(self.predictor, "name", type(self.predictor).__name__)
        return s

    def units(self) -> list[Unit]:
        raise NotImplementedError

    def run_unit(self, unit: Unit) -> list[dict]:
        raise NotImplementedError

    def execute(self, run: EvalRun, after_unit=None) -> dict:
        return run.execute(self.units(), self.run_unit, after_unit=after_unit)

    @staticmethod
    def aggregate(records: list[dict], spec: dict, out=None) -> dict:
        raise NotImplementedError

    # markdown: (headline metric keys, percent keys) for the summary table
    headline: tuple[str, ...] = ()


# With greedy decoding a unit (the resumable piece of a task) holds this many batches of examples and
# its prompts decode with --batch-size slots (continuous batching: a finished row's slot takes the next
# prompt; the tokens are those of decoding each alone). Sampled decoding keeps one batch per unit: its
# draws depend on which rows share a batch, and units must not depend on the number of ranks.
UNIT_BATCHES = 8


def chunk_units(examples: list[dict], batch_size: int, key=lambda e: e["id"]) -> list[Unit]:
    """Consecutive examples in groups of `batch_size` >= 1 (the last group may be smaller)."""
    units = []
    for i in range(0, len(examples), batch_size):
        group = examples[i:i + batch_size]
        units.append(Unit(len(units), [str(key(e)) for e in group], group))
    return units


class GenerationTask(Task):
    """A task that decodes: sampling options, a predictor, speed metrics in every result."""

    generation = True
    options = GenerationOptions
    overflow = False  # the task lets the cached families decode past max_seq_len (ModelPredictor's `overflow`)

    def __init__(self, args, shard, predictor=None):
        super().__init__(args, shard, predictor)
        self.overlong = {"policy": args.overlong, "overlong": 0, "skipped": 0, "skipped_keys": []}
        self.sampling = None
        if self.predictor is None:
            self.sampling = sampling_config(self.ckpt.cfg.objective, args, window=self.default_window(),
                                            **self.sampling_extra())
            self.predictor = ModelPredictor(self.ckpt, self.sampling, overflow=self.overflow)

    def prompt_room(self) -> int:
        """Prompt tokens every example needs beside the new tokens (0: unconditional prompts)."""
        return 1

    def check_fits(self) -> None:
        """Refuse, before the model loads, decoding that cannot fit the model's max_seq_len (called by
        eval.execute.execute once the task is set up)."""
        if self.sampling is None or self.ckpt is None:
            return
        need = self.prompt_room()
        if need == 0 and self.sampling.spec.next_token:
            need = 1  # next-token decoding (AR) starts an empty prompt from EOS
        prompt_budget(self.ckpt.cfg.model.max_seq_len, self.sampling.max_new_tokens, min_prompt=need)

    def fit(self, examples: list, sizes: list[int], *, what: str, option: str = "--data", floors=None,
            key=lambda e: e["id"]) -> list:
        """The examples that run under --overlong (eval/overlong.py), given each one's tokens with the
        decoded ones; records what was left out for the spec. Without a checkpoint (a test predictor)
        every example runs."""
        if self.ckpt is None:
            return examples
        keep, self.overlong = sort_overlong([str(key(e)) for e in examples], sizes, int(self.ckpt.cfg.model.max_seq_len),
                                            self.args.overlong, what=what, option=option, floors=floors)
        return [examples[i] for i in keep]

    def default_window(self) -> int | None:
        """SW-SetDLM window when --window is not given (None: D)."""
        return None

    def sampling_extra(self) -> dict:
        """Task-specific SamplingConfig fields (stop strings, window for infilling, ...)."""
        return {}

    def spec(self) -> dict:
        s = super().spec()
        s["batch_size"] = self.args.batch_size
        s["overlong"] = self.overlong
        if self.sampling is not None:
            s["sampling"] = sampling_spec(self.sampling)
        return s

    def unit_size(self) -> int:
        """Examples per unit (see UNIT_BATCHES); they decode with --batch-size slots."""
        greedy = self.sampling is not None and self.sampling.greedy
        return self.args.batch_size * (UNIT_BATCHES if greedy else 1)

    def unit_seed(self, unit: Unit) -> int:
        return seed_for(self.seed, self.name, unit.keys[0])


def speed_metrics(records: list[dict]) -> dict:
    """Decoding speed from generation records (prefill included; seconds of the example's batch)."""
    recs = [r for r in records if r.get("seconds")]
    if not recs:
        return {}
    tps = [r["n_tokens"] / r["seconds"] for r in recs if r["seconds"] > 0]
    steps = sum(r.get("steps", 0) for r in recs)
    toks = sum(r["n_tokens"] for r in recs)
    return {"speed/tokens_per_s": mean(tps), "speed/latency_s": mean([r["seconds"] for r in recs]),
            "speed/latency_p90_s": percentile([r["seconds"] for r in recs], 0.9),
            "speed/tokens_per_step": toks / steps if steps else None,
            "speed/steps": mean([r.get("steps", 0) for r in recs]), "speed/new_tokens": mean([r["n_tokens"] for r in recs])}


__all__ = ["UNIT_BATCHES", "Task", "GenerationTask", "chunk_units", "speed_metrics", "seed_for", "Unit"]
