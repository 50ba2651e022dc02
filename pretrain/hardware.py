"""The GPU a dry run plans for: peak FLOP/s, the efficiencies its kernels reach, link and memory
bandwidths, memory and GPUs per node (pretrain/steptime.py turns them into a step time).

`setdlm pretrain --dry-run --hardware h100|h200` picks a preset; environment numbers override any
field (validated like recipe keys: a value that is not a number in range is one line naming the
variable, exit status 2):

    SETDLM_PEAK_TFLOPS            dense bf16 peak per GPU (TFLOP/s)
    SETDLM_MATMUL_EFFICIENCY      share of the peak the model's matrix products reach (0-1]
    SETDLM_ATTENTION_EFFICIENCY   share of the peak the attention kernels reach (0-1]
    SETDLM_NVLINK_GBPS            NVLink bandwidth per GPU and direction (GB/s)
    SETDLM_INTERNODE_GBPS         network bandwidth per GPU and direction between nodes (GB/s)
    SETDLM_HBM_TBPS               memory bandwidth per GPU (TB/s)
    SETDLM_GPU_MEMORY_GIB         memory per GPU (GiB)
    SETDLM_GPUS_PER_NODE          GPUs per node (NVLink domain)

Where each preset number comes from:

- peak: NVIDIA's datasheets, dense (no sparsity) bf16 tensor-core rate of the SXM parts, 989 TFLOP/s
  for H100 and H200 (the same GH100 compute), as `pretrain/flops.py`'s PEAK_TFLOPS, which `perf/mfu`
  divides by;
- matmul efficiency 0.80: bf16 matrix products of 8192^3 measured at 790 TFLOP/s on an H200 of this
  workplace (benchmarks/gpu_report.py); H100 SXM has the same compute and clocks, so the same share;
- attention efficiency 0.32: FlashAttention-2 reaches about 370 TFLOP/s forward at head dim 128 on an
  H100 SXM (Shah et al. 2024, FlashAttention-3, fig. 5), and FlexAttention (the kernel training
  uses on CUDA, model/flex.py) about 90% of FlashAttention-2 forward and 85% backward (PyTorch's
  FlexAttention announcement, 2024): 370 x 0.87 / 989;
- NVLink 450 GB/s: NVLink 4 is 900 GB/s per GPU in both directions together (datasheets);
- between nodes 50 GB/s: one 400 Gb/s ConnectX-7 NIC per GPU (DGX H100 / H200 systems);
- HBM: 3.35 TB/s (H100 SXM, HBM3), 4.8 TB/s (H200, HBM3e) (datasheets);
- memory: 80 GiB for H100 (the planner's long-standing default); 139 GiB for H200 (what torch
  reports for the H200 of this workplace).

They are link and kernel *rates*: what a collective reaches in practice (NCCL's bus bandwidth) is
below the link rate, so measured communication times are longer than these give; override with the
measured numbers of a cluster (`nccl-tests`' bus bandwidth, a matmul benchmark) to plan for it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.envvars import env_number
from common.errors import UsageError

from .flops import PEAK_TFLOPS


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float  # dense bf16 tensor-core peak per GPU
    matmul_efficiency: float  # share of the peak the matrix products reach
    attention_efficiency: float  # share of the peak the attention kernels reach (on the allowed pairs)
    nvlink_gbps: float  # GB/s per GPU and direction inside a node
    internode_gbps: float  # GB/s per GPU and direction between nodes
    hbm_tbps: float  # TB/s of device memory
    memory_gib: float  # memory per GPU
    gpus_per_node: int

    @property
    def matmul_flops(self) -> float:
        """FLOP/s the matrix products run at."""
        return self.peak_tflops * 1e12 * self.matmul_efficiency

    @property
    def attention_flops(self) -> float:
        return self.peak_tflops * 1e12 * self.attention_efficiency

    def link_bytes_per_s(self, inside_node: bool) -> float:
        return (self.nvlink_gbps if inside_node else self.internode_gbps) * 1e9


PRESETS = {
    "h100": Hardware("H100 SXM", PEAK_TFLOPS["H100"], 0.80, 0.32, 450.0, 50.0, 3.35, 80.0, 8),
    "h200": Hardware("H200 SXM", PEAK_TFLOPS["H200"], 0.80, 0.32, 450.0, 50.0, 4.8, 139.0, 8),
}
DEFAULT = "h100"

# environment variable -> (field, kind, bounds)
OVERRIDES = {
    "SETDLM_PEAK_TFLOPS": ("peak_tflops", float, dict(gt=0, le=1e6), "dense bf16 TFLOP/s per GPU"),
    "SETDLM_MATMUL_EFFICIENCY": ("matmul_efficiency", float, dict(gt=0, le=1), "share of the peak matmuls reach"),
    "SETDLM_ATTENTION_EFFICIENCY": ("attention_efficiency", float, dict(gt=0, le=1),
                                    "share of the peak attention kernels reach"),
    "SETDLM_NVLINK_GBPS": ("nvlink_gbps", float, dict(gt=0, le=1e6), "NVLink GB/s per GPU and direction"),
    "SETDLM_INTERNODE_GBPS": ("internode_gbps", float, dict(gt=0, le=1e6), "network GB/s per GPU and direction"),
    "SETDLM_HBM_TBPS": ("hbm_tbps", float, dict(gt=0, le=1e3), "memory TB/s per GPU"),
    "SETDLM_GPU_MEMORY_GIB": ("memory_gib", float, dict(gt=0, le=1e6), "GiB of memory per GPU"),
    "SETDLM_GPUS_PER_NODE": ("gpus_per_node", int, dict(ge=1, le=1 << 20), "GPUs per node"),
}


def resolve_hardware(name: str | None = None) -> Hardware:
    """The preset `name` (default h100) with the SETDLM_ environment overrides applied."""
    key = (name or DEFAULT).lower()
    if key not in PRESETS:
        raise UsageError(f"--hardware: unknown GPU {name!r}; valid: {', '.join(PRESETS)}")
    hw = PRESETS[key]
    changes = {}
    for var, (field, kind, bounds, what) in OVERRIDES.items():
        default = getattr(hw, field)
        value = env_number(var, default, kind=kind, what=what, **bounds)
        if value != default:
            changes[field] = value
    return dataclasses.replace(hw, **changes) if changes else hw


def preset_of_device(device_name: str) -> str | None:
    """The preset of a CUDA device name (`torch.cuda.get_device_name()`), None when none matches."""
    name = device_name.upper()
    if "GH200" in name or "PCIE" in name or "NVL" in name:  # other parts: other rates
        return None
    for key in ("h200", "h100"):
        if key.upper() in name:
            return key
    return None


__all__ = ["Hardware", "PRESETS", "DEFAULT", "OVERRIDES", "resolve_hardware", "preset_of_device"]
