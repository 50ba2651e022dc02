#!/bin/bash
# setdlm: training under Open MPI's mpirun (one MPI rank per GPU; torch talks NCCL/gloo, MPI only launches).
#
#   NP=16 GPUS_PER_NODE=8 HOSTFILE=hosts.txt bash launch/templates/mpirun_train.sh --config FILE [section.key=value ...]
#
# Every rank runs $TRAIN_CMD (default `setdlm pretrain`) with this script's arguments, plus
# `--out $RUNS_DIR` / `--name $RUN_NAME` when those are set (run directory OUT/NAME; starting the same
# command again resumes from its last checkpoint). common/env.py reads OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE; rank 0's address is
# the first host of HOSTFILE (or this host), exported as MASTER_ADDR together with MASTER_PORT (a free
# port of this host); SETDLM_MASTER_ADDR / SETDLM_MASTER_PORT override both.
# Inside a Slurm allocation mpirun finds the nodes itself (no HOSTFILE needed); prefer the sbatch
# template there, which also handles preemption. mpirun forwards SIGUSR1/SIGUSR2 to the ranks
# (the trainer's PreemptionHandler saves on them) and turns SIGTERM into SIGTERM+SIGKILL.
# MPICH / Intel MPI: common/env.py understands PMI_RANK/PMI_SIZE too; replace the Open MPI options
# (--map-by, -x) by `-ppn $GPUS_PER_NODE -genvlist MASTER_ADDR,MASTER_PORT,...`.
set -euo pipefail
# launcher variables inherited from this shell (one that ran torchrun or init_distributed) would win
# over Open MPI's in common/env.py: drop them; SETDLM_MASTER_ADDR / SETDLM_MASTER_PORT override below
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK ROLE_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID

TRAIN_CMD=${TRAIN_CMD:-setdlm pretrain}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}           # ranks per node
HOSTFILE=${HOSTFILE:-}
if [ -n "$HOSTFILE" ]; then
  NNODES_DEFAULT=$(grep -cvE '^\s*(#|$)' "$HOSTFILE")
  FIRST_HOST=$(grep -vE '^\s*(#|$)' "$HOSTFILE" | head -n 1 | awk '{print $1}')
else
  NNODES_DEFAULT=${SLURM_JOB_NUM_NODES:-1}
  FIRST_HOST=$( (command -v scontrol >/dev/null && [ -n "${SLURM_JOB_NODELIST:-}" ] && scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) || hostname)
fi
NP=${NP:-$(( NNODES_DEFAULT * GPUS_PER_NODE ))}
RUN_NAME=${RUN_NAME:-}                      # passed as --name when set (default: the recipe's run.name)
RUNS_DIR=${RUNS_DIR:-}                      # passed as --out when set (default: the recipe's run.out_dir)
MPIRUN=${MPIRUN:-mpirun}
MPIRUN_ARGS=${MPIRUN_ARGS:-}                # e.g. "--allow-run-as-root --oversubscribe", "--mca btl_tcp_if_include ib0"

if [ "$NP" -le "$GPUS_PER_NODE" ] && [ -z "$HOSTFILE" ] && [ -z "${SLURM_JOB_NODELIST:-}" ]; then
  FIRST_HOST=127.0.0.1                      # one node: loopback always works
fi
export MASTER_ADDR=${SETDLM_MASTER_ADDR:-$FIRST_HOST}
export MASTER_PORT=${SETDLM_MASTER_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])' 2>/dev/null || echo $(( 20000 + $$ % 10000 )))}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONUNBUFFERED=1

read -r -a TRAIN <<<"$TRAIN_CMD"
read -r -a EXTRA <<<"$MPIRUN_ARGS"
ARGS=()
[ -n "$RUNS_DIR" ] && ARGS+=(--out "$RUNS_DIR")
[ -n "$RUN_NAME" ] && ARGS+=(--name "$RUN_NAME")
ARGS+=("$@")

# pass these to remote ranks (local ranks inherit the whole environment anyway)
XENV=()
for v in MASTER_ADDR MASTER_PORT PATH LD_LIBRARY_PATH PYTHONPATH VIRTUAL_ENV OMP_NUM_THREADS PYTHONUNBUFFERED \
         CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_DEBUG NCCL_SOCKET_IFNAME NCCL_IB_HCA \
         GLOO_SOCKET_IFNAME WANDB_MODE WANDB_API_KEY WANDB_PROJECT HF_HOME HF_HUB_OFFLINE HF_DATASETS_OFFLINE; do
  [ -n "${!v:-}" ] && XENV+=(-x "$v")
done

echo "[setdlm] mpirun np=$NP ranks/node=$GPUS_PER_NODE master=$MASTER_ADDR:$MASTER_PORT run=${RUNS_DIR:-<recipe>}/${RUN_NAME:-<recipe>} $(date -Is)"
exec "$MPIRUN" -np "$NP" ${HOSTFILE:+--hostfile "$HOSTFILE"} \
  --map-by "ppr:${GPUS_PER_NODE}:node" --bind-to none \
  "${XENV[@]}" "${EXTRA[@]}" \
  "${TRAIN[@]}" "${ARGS[@]}"
