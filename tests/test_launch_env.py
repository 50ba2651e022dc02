"""common.env.detect_env from synthetic launcher environments (no processes started)."""
from __future__ import annotations

import pytest

from common.env import (
    DistEnv,
    LauncherEnvError,
    detect_env,
    parse_hostlist,
    parse_tasks_per_node,
    slurm_master_port,
)


def _d(environ) -> DistEnv:
    return detect_env(environ, use_mpi4py=False)


def test_single_process_defaults():
    e = _d({"PATH": "/usr/bin"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.launcher) == (0, 1, 0, 1, "single")
    assert e.master_addr == "127.0.0.1" and e.master_port == 0  # 0 = pick a free port at init
    assert _d({"MASTER_ADDR": "elsewhere"}).master_addr == "127.0.0.1"  # no port: a local free one
    e = _d({"MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (e.launcher, e.master_addr, e.master_port) == ("single", "h", 1234)


@pytest.mark.slow
def test_init_distributed_single_process_group():
    """world size 1 still gets a (gloo) process group on a free port, idempotently."""
    import subprocess
    import sys

    code = ("import os, torch.distributed as dist\n"
            "for k in [k for k in os.environ if k.startswith(('RANK','WORLD_SIZE','LOCAL_','MASTER_','SLURM_','OMPI_','PMI'))]:\n"
            "    del os.environ[k]\n"
            "from common.dist import init_process_group\n"
            "e = init_process_group(); e2 = init_process_group()\n"
            "assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == 'gloo'\n"
            "assert e.launcher == 'single' and e.master_port > 0 and os.environ['RANK'] == '0'\n"
            "assert (e2.rank, e2.world_size) == (0, 1)\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


def test_torchrun():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "node7", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "x"}
    e = _d(env)
    assert e == DistEnv(5, 8, 1, 4, "node7", 29400, "torchrun")
    assert e.node_rank == 1


def test_torchrun_wins_over_slurm_inside_a_step():
    # torchrun worker started by srun: SLURM_PROCID is the node's task id, RANK the worker's rank
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "n1", "MASTER_PORT": "1234",
           "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0",
           "SLURM_JOB_NODELIST": "n[1-2]"}
    e = _d(env)
    assert (e.rank, e.world_size, e.local_rank, e.launcher) == (3, 4, 1, "torchrun")


def test_slurm_srun_tasks():
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
           "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
           "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu-[007-008]",
           "SLURM_STEP_NODELIST": "gpu-[007-008]"}
    e = _d(env)
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size) == (5, 8, 1, 4)
    assert e.launcher == "slurm"
    assert e.master_addr == "gpu-007"
    assert e.master_port == slurm_master_port(123456) == 12000 + 123456 % 20000


def test_slurm_batch_script_itself_is_a_single_process():
    # what the batch shell sees of a --ntasks=2 job (no SLURM_STEP_ID): python started there is alone
    env = {"SLURM_JOB_ID": "8", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost"}
    e = _d(env)
    assert (e.launcher, e.world_size) == ("single", 1)


def test_slurm_port_is_same_for_every_task_and_explicit_values_win():
    base = {"SLURM_STEPID": "3", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "a,b",
            "SLURM_TASKS_PER_NODE": "1(x2)"}
    ports = {_d({**base, "SLURM_PROCID": str(r), "SLURM_NODEID": str(r)}).master_port for r in range(2)}
    assert len(ports) == 1
    e = _d({**base, "SLURM_PROCID": "1", "SLURM_NODEID": "1", "MASTER_ADDR": "head", "MASTER_PORT": "999"})
    assert (e.master_addr, e.master_port, e.local_world_size) == ("head", 999, 1)


def test_slurm_uneven_tasks_per_node():
    env = {"SLURM_STEP_ID": "1", "SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
           "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "x[1-3]"}
    e = _d(env)
    assert (e.local_world_size, e.master_addr) == (1, "x1")


def test_openmpi():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "MASTER_ADDR": "h0", "MASTER_PORT": "4000"}
    assert _d(env) == DistEnv(3, 4, 1, 2, "h0", 4000, "mpi")


def test_openmpi_single_node_needs_no_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "OMPI_MCA_ess_base_jobid": "3735552001"}
    e = _d(env)
    assert (e.master_addr, e.launcher) == ("127.0.0.1", "mpi")
    assert e.master_port == slurm_master_port("3735552001")


def test_openmpi_across_nodes_without_address_is_a_clear_error():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(LauncherEnvError, match="MASTER_ADDR"):
        _d(env)


def test_mpirun_inside_sbatch_beats_inherited_slurm_vars():
    # batch step variables (SLURM_PROCID=0 for everyone) leak into mpirun's ranks
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "5",
           "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_ID": "0",
           "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    e = _d(env)
    assert (e.rank, e.launcher) == (1, "mpi")
    # under srun --mpi=pmix the two agree: reported as Slurm
    env.update(SLURM_PROCID="1", SLURM_LOCALID="1")
    assert _d(env).launcher == "slurm"


def test_mpich_hydra_and_mvapich():
    env = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1",
           "MASTER_ADDR": "m", "MASTER_PORT": "5000"}
    assert _d(env) == DistEnv(2, 3, 0, 1, "m", 5000, "mpi")
    env = {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2",
           "MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_LOCAL_SIZE": "2"}
    e = _d(env)
    assert (e.rank, e.world_size, e.local_rank, e.master_addr) == (1, 2, 1, "127.0.0.1")


def test_pmix_rank_without_size_needs_mpi4py():
    with pytest.raises(LauncherEnvError, match="world size"):
        _d({"PMIX_RANK": "0"})


@pytest.mark.parametrize(
    "env, match",
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "70000"}, "port"),
        ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "two"},
         "tasks-per-node"),
    ],
)
def test_bad_values_are_named(env, match):
    with pytest.raises(LauncherEnvError, match=match):
        _d(env)


def test_hostlist_and_tasks_per_node_parsers():
    assert parse_hostlist("node[01-03,7],login,gpu[1-2]-ib") == [
        "node01", "node02", "node03", "node7", "login", "gpu1-ib", "gpu2-ib"]
    assert parse_hostlist("localhost") == ["localhost"]
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("8") == [8]


def test_a_free_port_is_drawn_below_the_ephemeral_range():
    """A local run's master port comes from below the ports the kernel hands to outgoing connections
    and gloo's listeners, so no other process can take it between the draw and the rank-0 bind."""
    import socket

    from common.env import LOCAL_PORT_FLOOR, _ephemeral_range, find_free_port

    lo, _ = _ephemeral_range()
    ports = {find_free_port() for _ in range(8)}
    assert all(LOCAL_PORT_FLOOR <= p < lo for p in ports) and len(ports) > 1, ports
    for p in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))
