"""The files of a format-2 checkpoint, through torch.distributed.checkpoint (DCP).

Every tensor of the checkpoint is a *global* tensor: the full (TP=1, PP=1) shape of a weight, an fp32
master, an Adam moment or an EMA average. A rank contributes, and reads back, rectangular chunks of
those tensors at their offsets (`Chunked`), whatever layout it runs under; DCP stores each chunk once,
records every chunk's offsets in the checkpoint's `.metadata`, and on load reads, for each chunk a rank
asks for, the overlapping parts of the stored chunks (its resharding by chunk overlap). So a checkpoint
saved under one TP x PP x DP x CP layout and ZeRO stage is read under any other.

    boxes(shape, start, end)   the rectangles covering flat elements [start, end) of a tensor of
                               `shape` (at most 2 * ndim - 1; a flat range of a matrix: at most three)
    Chunked                    the pieces of one global tensor this rank holds: (offsets, tensor)
    ChunkSavePlanner / ChunkLoadPlanner   DCP planners for dicts of Chunked (DCP's own extension points)
    SafeReader                 DCP's FileSystemReader whose `.metadata` is unpickled through an
                               allow-list of DCP's metadata classes (nothing in it can run code); tensor
                               items are read by DCP with torch.load(weights_only=True)
    read_metadata / read_full  what a checkpoint holds; whole tensors of some keys in one process

No byte (pickled object) items are written or read: non-tensor state (RNG, data position, meta.json)
lives in plain files read as weights only (pretrain/safe_load.py) or as JSON.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import zipfile
from pathlib import Path
from typing import Iterable

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: caught by name
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..safe_load import CheckpointError

METADATA = ".metadata"  # DCP's index of a checkpoint folder (written last, by the coordinator)
# the keys of a setdlm checkpoint: PREFIX + the TP=1 model's parameter name (train_state.py)
MODEL, EXP_AVG, EXP_AVG_SQ, EMA = "model/", "optim/exp_avg/", "optim/exp_avg_sq/", "ema/"


# -- geometry ----------------------------------------------------------------------------------------
def boxes(shape, start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the boxes that cover flat elements [start, end) of a C-contiguous tensor of
    `shape`, in flat order; each box is one contiguous run of those elements."""
    shape = tuple(int(s) for s in shape)
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(end, inner)
    zeros = (0,) * (len(shape) - 1)
    if i0 == i1:  # inside one slice along the first dim
        return [((i0, *o), (1, *s)) for o, s in boxes(shape[1:], r0, r1)]
    out = []
    if r0:
        out += [((i0, *o), (1, *s)) for o, s in boxes(shape[1:], r0, inner)]
        i0 += 1
    if i1 > i0:
        out.append(((i0, *zeros), (i1 - i0, *shape[1:])))
    if r1:
        out += [((i1, *o), (1, *s)) for o, s in boxes(shape[1:], 0, r1)]
    return out


@dataclasses.dataclass
class Chunked:
    """The pieces of one global tensor (`shape`, stored as `dtype`) that this rank writes or reads:
    (global offsets, tensor of the piece's size). For a load the tensors are where the values go (views
    into the engine's own buffers: written in place)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[tuple[tuple[int, ...], torch.Tensor]] = dataclasses.field(default_factory=list)

    def add_flat(self, local_shape, offset, flat: torch.Tensor, start: int) -> None:
        """Add the elements [start, start + flat.numel()) of a local tensor of `local_shape`, which sits at
        `offset` in the global tensor (a tensor-parallel shard), held in the 1-D tensor `flat`."""
        pos = 0
        for o, s in boxes(local_shape, start, start + flat.numel()):
            n = math.prod(s)
            self.pieces.append((tuple(a + b for a, b in zip(o, offset)), flat[pos:pos + n].view(s)))
            pos += n

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self.pieces]

    def nbytes(self) -> int:
        return sum(t.numel() for _, t in self.pieces) * torch.empty((), dtype=self.dtype).element_size()


# -- planners ----------------------------------------------------------------------------------------
class ChunkSavePlanner(DefaultSavePlanner):
    """Writes a flat dict {key: Chunked} (pieces already staged in host memory). A piece offered by
    several ranks (a replicated weight) is written once: DCP's plan de-duplication keeps one."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            props = TensorProperties(dtype=obj.dtype)
            for offsets, t in obj.pieces:
                off = torch.Size(offsets)
                items.append(WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.shape),
                                                                   properties=props, size=torch.Size(obj.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        for offsets, t in self.state_dict[index.fqn].pieces:
            if torch.Size(offsets) == index.offset:
                return t
        raise ValueError(f"no piece of {index.fqn} at {tuple(index.offset)}")


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads a flat dict {key: Chunked} in place: each piece gets the overlapping parts of the stored
    chunks (DCP's `create_read_items_for_chunk_list`). Shapes are checked against the checkpoint first
    (`check_shapes`); byte items are refused (setdlm writes none)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # not the default's: it would replace the Chunked values, which are not tensors
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint: {fqn} is {'missing' if md is None else 'not a tensor'}")
            if obj.pieces:
                items += create_read_items_for_chunk_list(fqn, md, obj.chunks())
        self.plan = LoadPlan(items)
        return self.plan

    def resolve_tensor(self, read_item):
        offsets, t = self.state_dict[read_item.dest_index.fqn].pieces[read_item.dest_index.index]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, start, length)
        return t

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # written in place

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint: {read_item.dest_index.fqn} is a pickled object; setdlm reads tensors only")


# -- reading metadata without running code -----------------------------------------------------------
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"),  # torch's own pickling of a layout: a name -> layout lookup
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
     ("collections", "OrderedDict")}
_DTYPES = {str(d).split(".")[-1] for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
_LAYOUTS = {"strided"}


class _MetadataUnpickler(pickle.Unpickler):
    """Python's documented way to restrict what a pickle may name: only DCP's metadata records, torch
    dtypes/layouts/memory formats and torch.Size; anything else (a function to call) is refused."""

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and (name in _DTYPES or name in _LAYOUTS or name in ("contiguous_format", "preserve_format",
                                                                                   "channels_last", "channels_last_3d")):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


def read_metadata(ckpt: Path) -> Metadata:
    """The DCP index of checkpoint folder `ckpt` (CheckpointError naming it when missing, damaged or
    naming anything but DCP's records)."""
    f = Path(ckpt) / METADATA
    try:
        with open(f, "rb") as stream:
            md = _MetadataUnpickler(stream).load()
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing (the checkpoint's index; an incomplete copy)") from None
    except pickle.UnpicklingError as e:
        if "Unsupported global" in str(e):
            raise CheckpointError(f"{f}: refused: it names {str(e).split('GLOBAL ')[-1]}, which would run code when "
                                  "loaded; setdlm reads checkpoints as data only. Do not use files from an untrusted "
                                  "source") from None
        raise CheckpointError(f"{f}: damaged ({e})") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
        raise CheckpointError(f"{f}: unreadable or damaged ({type(e).__name__})") from None
    if (not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict)
            or not isinstance(md.storage_data, dict)):
        raise CheckpointError(f"{f}: not a torch.distributed.checkpoint index")
    return md


class SafeReader(FileSystemReader):
    """FileSystemReader with the allow-listed metadata read (tensor items: torch.load(weights_only=True));
    a refused or damaged item is a CheckpointError naming its file."""

    def read_data(self, plan, planner):
        from ..safe_load import _unpickling_error

        files = sorted({self.storage_data[r.storage_index].relative_path for r in plan.items})
        where = ", ".join(str(Path(self.path) / f) for f in files[:2]) or str(self.path)
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except pickle.UnpicklingError as e:
            raise _unpickling_error(where, e) from None
        except (EOFError, OSError, RuntimeError, ValueError, KeyError, IndexError, TypeError, AssertionError,
                zipfile.BadZipFile) as e:
            raise CheckpointError(f"{where}: truncated or damaged ({type(e).__name__}); use another step") from None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = read_metadata(Path(self.path))
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def check_files(ckpt: Path, md: Metadata) -> None:
    """Every data file the index names is there and long enough, else one line naming the first missing
    (a rank's file not copied) or cut-short ones."""
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if not isinstance(path, str) or "/" in path or path.startswith("."):
            raise CheckpointError(f"{Path(ckpt) / METADATA}: names a data file outside the checkpoint ({path!r})")
        need[path] = max(need.get(path, 0), int(info.offset) + int(info.length))
    missing = sorted(f for f in need if not (Path(ckpt) / f).is_file())
    if missing:
        raise CheckpointError(f"checkpoint {ckpt}: incomplete: {', '.join(missing[:3])} missing ({len(need)} data "
                              "files, one per rank that saved); copy the whole checkpoint directory, or use another step")
    for f in sorted(need):
        size = (Path(ckpt) / f).stat().st_size
        if size < need[f]:
            raise CheckpointError(f"{Path(ckpt) / f}: " + ("empty file (0 bytes)" if not size else
                                  f"truncated ({size} of {need[f]} bytes)") + ": the checkpoint is damaged; use another step")


def tensor_shapes(md: Metadata) -> dict[str, tuple[int, ...]]:
    """{key: global shape} of the tensors a checkpoint holds."""
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def writer(path: Path) -> FileSystemWriter:
    """One file per rank (plus the coordinator's .metadata), fsynced before the save returns."""
    return FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True, thread_count=1)


def load(state: dict[str, Chunked], ckpt: Path, *, process_group=None, no_dist: bool = False) -> None:
    """Fill the pieces of `state` from checkpoint folder `ckpt` (collective over `process_group` unless
    `no_dist`). Keys and shapes must have been checked (`check_shapes`)."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, storage_reader=SafeReader(str(ckpt)), planner=ChunkLoadPlanner(), process_group=process_group,
                 no_dist=no_dist)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps a rank's failure (a damaged file)
        inner = _inner(e)
        if isinstance(inner, CheckpointError):
            raise CheckpointError(str(inner)) from None
        raise CheckpointError(f"checkpoint {ckpt}: cannot be read ({first_cause(e)})") from None


def _inner(e: BaseException) -> BaseException:
    """The first failing rank's own exception inside DCP's CheckpointException (else `e`)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = failures[min(failures)]
        inner = inner[0] if isinstance(inner, tuple) else getattr(inner, "exc", inner)
        if isinstance(inner, BaseException):
            return inner
    return e


def first_cause(e: BaseException) -> str:
    """One line for a DCP failure: the first rank's own exception (DCP's CheckpointException keeps one per
    rank), else `e`."""
    inner = _inner(e)
    if inner is not e:
        text = str(inner).strip().splitlines()
        return f"rank {min(e.failures)}: {type(inner).__name__}: {text[0][:200] if text else ''}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def check_shapes(state: dict[str, Chunked], md: Metadata, ckpt: Path) -> None:
    """Each requested key is in the checkpoint with the same global shape (else one line naming it)."""
    have = tensor_shapes(md)
    for key, obj in state.items():
        if key not in have:
            raise CheckpointError(f"checkpoint {ckpt}: no {key} (a different model, or an incomplete checkpoint)")
        if tuple(have[key]) != tuple(obj.shape):
            raise CheckpointError(f"checkpoint {ckpt}: {key} has shape {tuple(have[key])}, this model needs "
                                  f"{tuple(obj.shape)} (a different model configuration?)")


def read_full(ckpt: Path, keys: Iterable[str], md: Metadata | None = None, *, dtype=None) -> dict[str, torch.Tensor]:
    """Whole tensors of `keys` of checkpoint `ckpt`, read in this process (no process group): each is
    allocated once and filled chunk by chunk."""
    md = md or read_metadata(ckpt)
    shapes = tensor_shapes(md)
    out, state = {}, {}
    for k in keys:
        meta = md.state_dict_metadata[k]
        t = torch.empty(shapes[k], dtype=dtype or meta.properties.dtype)
        out[k] = t
        state[k] = Chunked(tuple(t.shape), t.dtype, [((0,) * t.dim(), t)])
    if state:
        load(state, ckpt, no_dist=True)
    return out


def whole_state(ckpt: Path, *, module: bool = True, ema: bool = True, optimizer: bool = False,
                ema_over_module: bool = False) -> dict:
    """The full (TP=1, PP=1) tensors of a format-2 checkpoint, in this process (no process group):
    {"module": {name: fp32}, "ema": {name: fp32} or None, "optimizer": {"exp_avg": {...}, "exp_avg_sq": {...}}
    or None}. `ema_over_module`: the module weights of parameters with an EMA are not read (the caller
    uses the EMA instead; one copy of the model in memory)."""
    ckpt = Path(ckpt)
    md = read_metadata(ckpt)
    check_files(ckpt, md)
    keys = list(tensor_shapes(md))

    def names(prefix):
        return [k[len(prefix):] for k in keys if k.startswith(prefix)]

    ema_names = names(EMA) if ema else []
    if ema and ema_names:
        shapes = tensor_shapes(md)
        for n in ema_names:
            if shapes.get(MODEL + n) not in (None, shapes[EMA + n]):
                raise CheckpointError(f"checkpoint {ckpt}: {EMA + n} has shape {shapes[EMA + n]} where {MODEL + n} has "
                                      f"{shapes[MODEL + n]}: a damaged checkpoint")
    skip = set(ema_names) if ema_over_module else set()
    want = ([MODEL + n for n in names(MODEL) if n not in skip] if module else []) + [EMA + n for n in ema_names]
    moments = (EXP_AVG, EXP_AVG_SQ) if optimizer and names(EXP_AVG) else ()
    for prefix in moments:
        want += [prefix + n for n in names(prefix)]
    got = read_full(ckpt, want, md, dtype=torch.float32)

    def part(prefix):
        return {k[len(prefix):]: v for k, v in got.items() if k.startswith(prefix)}

    return {"module": part(MODEL) if module else None, "ema": part(EMA) if ema_names else None,
            "optimizer": {"exp_avg": part(EXP_AVG), "exp_avg_sq": part(EXP_AVG_SQ)} if moments else None}


def stage(state: dict[str, Chunked], cache: dict | None = None, pin: bool = False) -> dict[str, Chunked]:
    """The snapshot a background write works from: every piece copied into its own host buffer (in
    `dtype`), so training can change the originals; `cache` keeps the buffers for the next save."""
    out = {}
    for key, obj in state.items():
        pieces = []
        for offsets, t in obj.pieces:
            slot = (key, offsets, tuple(t.shape), obj.dtype)
            buf = cache.get(slot) if cache is not None else None
            if buf is None:
                buf = torch.empty(t.shape, dtype=obj.dtype, device="cpu", pin_memory=pin)
                if cache is not None:
                    cache[slot] = buf
            buf.copy_(t.detach(), non_blocking=pin)
            pieces.append((offsets, buf))
        out[key] = Chunked(obj.shape, obj.dtype, pieces)
    if pin and torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


__all__ = ["METADATA", "boxes", "Chunked", "ChunkSavePlanner", "ChunkLoadPlanner", "SafeReader", "read_metadata",
           "check_files", "whole_state", "tensor_shapes", "MODEL", "EXP_AVG", "EXP_AVG_SQ", "EMA", "writer", "load", "check_shapes", "read_full", "stage", "first_cause"]
