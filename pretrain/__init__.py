"""pretrain package."""

import warnings

# megatron-core warns at import time when Transformer Engine / apex are absent (CPU machines); the
# stack checks for them explicitly where they matter (FP8, fused kernels).
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
