"""How a decoder's step runs: eagerly, through torch.compile, or replayed as a CUDA graph.

`SamplingConfig.compile` selects the compiled step. The decoders make that possible: their step
(`device_step`) is device tensor ops only with no host read, it updates the preallocated state tensors
in place, and with `compile` its shapes are fixed per (batch bucket, window): the canvas width and the
cache capacity are rounded up to multiples of 64, the forward attends to the whole preallocated KV
cache (entries past each row's length are masked), and the batch only shrinks to powers of two.

- eager (`compile: false`): the step as Python calls it.
- compile: `torch.compile(device_step, dynamic=False)`; a new shape (batch bucket) recompiles.
- CUDA graph (`compile: true` on CUDA with greedy decoding and `cuda_graphs: true`): the first step of
  a shape runs the compiled function on a side stream (warm-up, a real step), the second is captured
  into a `torch.cuda.CUDAGraph` and replayed, and every later step is one `replay()`: no Python, no
  kernel launches from the host, no synchronisation. Admitting a prompt into a slot writes into the
  same tensors, so the graph stays valid; shrinking the batch drops it (`reset`) and the next two
  steps capture the new shape. Sampling (temperature > 0) is not captured (its generator is not
  graph-safe here): it runs compiled without a graph.
"""

from __future__ import annotations

import warnings

import torch


def _compile(fn):
    # a layer that calls warnings.warn on every forward (a multi-rank linear's deprecation notice)
    # would otherwise break the graph at each call (many small graphs).
    cfg = torch._dynamo.config
    if warnings.warn not in cfg.reorderable_logging_functions:
        cfg.reorderable_logging_functions.add(warnings.warn)
    return torch.compile(fn, dynamic=False)


class DecodeStepRunner:
    def __init__(self, dec):
        self.dec = dec
        cfg = dec.cfg
        self.compiled = bool(cfg.compile) and dec.compilable
        self.graphs = (self.compiled and cfg.cuda_graphs and cfg.greedy and dec.device.type == "cuda")
        self.fn = _compile(dec.device_step) if self.compiled else dec.device_step
        if self.compiled and dec.device.type == "cpu":  # the compiled step reads the head's CPU layout as built here
            dec.model.transposed_head()
        self.reset()

    @property
    def mode(self) -> str:
        return "cudagraph" if self.graphs else ("compile" if self.compiled else "eager")

    def reset(self) -> None:
        """The state tensors changed (batch shrunk): capture again."""
        self.graph = None
        self.warm = 0

    def __call__(self) -> None:
        if not self.graphs:
            self.fn()
            return
        if self.graph is not None:
            self.graph.replay()
            return
        if self.warm == 0:  # warm-up (compilation, library handles) on a side stream: a real step
            side = torch.cuda.Stream(device=self.dec.device)
            side.wait_stream(torch.cuda.current_stream(self.dec.device))
            with torch.cuda.stream(side):
                self.fn()
            torch.cuda.current_stream(self.dec.device).wait_stream(side)
            self.warm = 1
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.fn()  # recorded, not run
        self.graph = graph
        graph.replay()
