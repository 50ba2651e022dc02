"""pretrain.ranks.read_ranks (the rank reader below launch/) agrees with launch.env.detect_env."""

from __future__ import annotations

import pytest

from launch.env import detect_env
from pretrain.ranks import read_ranks

ENVIRONMENTS = {
    "single": {"PATH": "/usr/bin"},
    "torchrun": {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n7", "MASTER_PORT": "29400"},
    "torchrun in a Slurm step": {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "SLURM_PROCID": "1",
                                 "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77"},
    "srun tasks": {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
                   "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "localhost"},
    "the batch script itself": {"SLURM_JOB_ID": "8", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
    "mpirun inside sbatch": {"SLURM_JOB_ID": "8", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0",
                             "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
    "Open MPI": {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
    "MPICH": {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"},
}


@pytest.mark.parametrize("name", ENVIRONMENTS)
def test_same_answer_as_the_launcher_reader(name):
    env = ENVIRONMENTS[name]
    want = detect_env(env, use_mpi4py=False)
    got = read_ranks(env)
    assert (got.rank, got.world_size, got.local_rank, got.launcher) == (
        want.rank, want.world_size, want.local_rank, want.launcher), name


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="RANK='x'"):
        read_ranks({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="outside"):
        read_ranks({"RANK": "2", "WORLD_SIZE": "2"})
