"""Count what torch.distributed's collectives move, per process group (a test helper).

    counter = CommCounter().install()       # in a rank, before the code under test runs its collectives
    ...                                     # build, train a step
    counter.uninstall()
    counter.by_group()                      # {(ranks...): {"all_reduce": bytes, "all_gather": bytes, ...}}
    counter.sent_per_rank(ranks)            # the bytes one rank of that group sends under ring algorithms

Every collective and point-to-point function of `torch.distributed` is wrapped (all_reduce, all_gather,
all_gather_into_tensor / all_gather_single (torch 2.13's name), _all_gather_base, reduce_scatter,
reduce_scatter_tensor / reduce_scatter_single, _reduce_scatter_base, reduce, broadcast,
all_to_all(_single), gather, scatter, send / recv / isend / irecv, batch_isend_irecv,
all_reduce_coalesced); a name this torch lacks is skipped. Each call is recorded once with the group's global ranks
and the collective's *logical* payload:

    all_reduce, reduce, broadcast            the tensor's bytes
    all_gather(_into_tensor), gather         the gathered result (all ranks' parts together)
    reduce_scatter(_tensor), scatter         the full input (all ranks' parts together)
    send / isend, recv / irecv               the tensor's bytes (sent / received)

A call made from inside another wrapped call (all_gather_object calls all_gather) is counted once, at
the outside. The wrapper rebinds the functions in `torch.distributed` and in every loaded module that
holds a reference to them (megatron-core keeps `dist_all_gather_func = torch.distributed.all_gather_into_tensor`
at import), so install it before the code under test creates DeepSpeed's communication backend (which
keeps its own references when it is created); `uninstall` puts everything back.

`ring_bytes` turns a payload into what one rank sends under the ring algorithms NCCL and gloo use for
large buffers: an all-reduce of N bytes over n ranks sends 2 (n-1)/n N per rank, an all-gather or a
reduce-scatter of N bytes (n-1)/n N; a reduce or broadcast, pipelined along a chain, (n-1)/n N per rank
on average. That is the quantity pretrain/comm.py predicts (the plan's "bytes per GPU").
"""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

# name -> how its payload is measured: "tensor" (the first tensor argument), "out" (the output: a
# tensor or a list of tensors), "in" (the input: a tensor or a list), "p2p_send" / "p2p_recv", "ops"
# (batch_isend_irecv's P2POp list), "list" (a list of tensors: all_reduce_coalesced)
WRAPPED = {
    "all_reduce": ("all_reduce", "tensor"), "all_reduce_coalesced": ("all_reduce", "list"),
    "reduce": ("reduce", "tensor"), "broadcast": ("broadcast", "tensor"),
    "all_gather": ("all_gather", "out"), "all_gather_into_tensor": ("all_gather", "out"),
    "all_gather_single": ("all_gather", "out"), "_all_gather_base": ("all_gather", "out"),
    "gather": ("gather", "gather"),
    "reduce_scatter": ("reduce_scatter", "in"), "reduce_scatter_tensor": ("reduce_scatter", "in"),
    "reduce_scatter_single": ("reduce_scatter", "in"), "_reduce_scatter_base": ("reduce_scatter", "in"),
    "scatter": ("scatter", "scatter"),
    "all_to_all": ("all_to_all", "in"), "all_to_all_single": ("all_to_all", "in"),
    "send": ("send", "p2p"), "isend": ("send", "p2p"), "recv": ("recv", "p2p"), "irecv": ("recv", "p2p"),
    "batch_isend_irecv": ("p2p", "ops"),
}
# argument position of the payload for "tensor"/"p2p" (first), "out" (first), "in" (second) calls
_IN_POS = {"reduce_scatter": 1, "reduce_scatter_tensor": 1, "reduce_scatter_single": 1, "_reduce_scatter_base": 1,
           "all_to_all": 1, "all_to_all_single": 1}


@dataclass
class Record:
    op: str  # all_reduce, all_gather, reduce_scatter, reduce, broadcast, send, recv, ...
    ranks: tuple  # the group's global ranks
    nbytes: int  # the logical payload (module docstring)
    dtype: str
    name: str  # the torch.distributed function called


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _dtype(x) -> str:
    if isinstance(x, torch.Tensor):
        return str(x.dtype).removeprefix("torch.")
    if isinstance(x, (list, tuple)) and x:
        return _dtype(x[0])
    return "?"


_RANKS: dict[int, tuple] = {}  # id(group) -> (group, its global ranks): the group is kept, so its id stays its own


def _group_ranks(group) -> tuple:
    if group is None:
        return tuple(range(dist.get_world_size()))
    hit = _RANKS.get(id(group))
    if hit is None or hit[0] is not group:
        hit = _RANKS[id(group)] = (group, tuple(dist.get_process_group_ranks(group)))
    return hit[1]


def ring_bytes(op: str, n: int, nbytes: float) -> float:
    """Bytes one rank sends for a collective of `nbytes` payload over `n` ranks (module docstring)."""
    if op == "send":
        return float(nbytes)
    if op == "recv" or n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    return (n - 1) / n * nbytes  # all_gather, reduce_scatter, reduce, broadcast, gather, scatter, all_to_all


class CommCounter:
    def __init__(self):
        self.records: list[Record] = []
        self._saved: list[tuple[object, str, object]] = []
        self._local = threading.local()
        self.enabled = True

    # -- recording -------------------------------------------------------------------------------------
    def _record(self, name: str, args: tuple, kwargs: dict) -> None:
        op, how = WRAPPED[name]
        group = kwargs.get("group")
        if how == "ops":
            for p2p in args[0] if args else kwargs.get("p2p_op_list", []):
                kind = "send" if "send" in getattr(p2p.op, "__name__", "") else "recv"
                self.records.append(Record(kind, _group_ranks(p2p.group), _nbytes(p2p.tensor), _dtype(p2p.tensor), name))
            return
        if how in ("tensor", "p2p", "list"):
            x = args[0] if args else kwargs.get("tensor", kwargs.get("tensors"))
        elif how == "out":
            x = args[0] if args else kwargs.get("output_tensor", kwargs.get("tensor_list", kwargs.get("output")))
        elif how == "in":
            pos = _IN_POS.get(name, 1)
            x = args[pos] if len(args) > pos else kwargs.get(
                "input", kwargs.get("input_tensor", kwargs.get("input_list", kwargs.get("input_tensor_list"))))
        elif how == "gather":  # the gathered list on the destination (what the group moves in all)
            x = args[0] if args else kwargs.get("tensor")
            n = len(_group_ranks(group))
            self.records.append(Record(op, _group_ranks(group), _nbytes(x) * n, _dtype(x), name))
            return
        else:  # scatter: the scattered list's total, known from one part
            x = args[0] if args else kwargs.get("tensor")
            n = len(_group_ranks(group))
            self.records.append(Record(op, _group_ranks(group), _nbytes(x) * n, _dtype(x), name))
            return
        if how == "p2p" and group is None:
            ranks = tuple(range(dist.get_world_size()))
        else:
            ranks = _group_ranks(group)
        self.records.append(Record(op, ranks, _nbytes(x), _dtype(x), name))

    def _wrap(self, name: str, fn):
        counter = self

        def wrapper(*args, **kwargs):
            local = counter._local
            outer = not getattr(local, "inside", False)
            if outer and counter.enabled:
                counter._record(name, args, kwargs)
            local.inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                if outer:
                    local.inside = False

        wrapper.__wrapped__ = fn
        wrapper.__name__ = fn.__name__
        wrapper._comm_counter = self
        return wrapper

    # -- installing ------------------------------------------------------------------------------------
    def install(self) -> "CommCounter":
        """Wrap the functions in torch.distributed and rebind every loaded module's reference to them."""
        originals = {}
        for name in WRAPPED:
            fn = getattr(dist.distributed_c10d, name, None) or getattr(dist, name, None)
            if fn is None:
                continue
            if getattr(fn, "_comm_counter", None) is not None:
                raise RuntimeError("a CommCounter is already installed")
            originals[name] = (fn, self._wrap(name, fn))
        by_id = {id(fn): wrapped for fn, wrapped in originals.values()}
        for module in list(sys.modules.values()):
            d = getattr(module, "__dict__", None)
            if not isinstance(d, dict):
                continue
            for attr, value in list(d.items()):
                wrapped = by_id.get(id(value))
                if wrapped is not None and callable(value):
                    self._saved.append((module, attr, value))
                    setattr(module, attr, wrapped)
        return self

    def uninstall(self) -> None:
        for module, attr, value in reversed(self._saved):
            setattr(module, attr, value)
        self._saved.clear()

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()

    # -- summaries -------------------------------------------------------------------------------------
    def clear(self) -> None:
        self.records.clear()

    def by_group(self) -> dict[tuple, dict[str, int]]:
        """{group ranks: {op: payload bytes summed}}."""
        out: dict[tuple, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for r in self.records:
            out[r.ranks][r.op] += r.nbytes
        return {k: dict(v) for k, v in out.items()}

    def sent_per_rank(self, ranks: tuple, ops: tuple | None = None) -> float:
        """Bytes one rank of the group `ranks` sends (ring algorithms) over the recorded calls."""
        n = len(ranks)
        return sum(ring_bytes(r.op, n, r.nbytes) for r in self.records
                   if r.ranks == tuple(ranks) and (ops is None or r.op in ops))

    def calls(self, ranks: tuple | None = None) -> list[Record]:
        return [r for r in self.records if ranks is None or r.ranks == tuple(ranks)]


__all__ = ["CommCounter", "Record", "ring_bytes", "WRAPPED"]
