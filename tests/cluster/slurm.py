"""Start a real one-node Slurm cluster (munge + slurmctld + slurmd) for tests.

Needs root and Debian's ``slurm-wlm`` and ``munge`` packages (``scripts/install.sh --test``
installs them as root). Everything lives in a private directory: the configuration is found
through ``SLURM_CONF`` (exported to the clients and, by ``sbatch``'s default ``--export=ALL``,
to the jobs), daemons listen on free ports, and state/log/spool files stay in that directory, so
the system's ``/etc/slurm`` is never touched. A private ``munged`` (run as the ``munge`` user, its
own random key and socket, ``AuthInfo=socket=...``) serves only this cluster, so ``/run/munge`` and
``/etc/munge`` are not needed and concurrent test sessions do not interfere.

Usage::

    with SlurmCluster(tmpdir) as cluster:
        job = cluster.sbatch(["script.sbatch", "arg"], extra=["--ntasks=2"])
        state = cluster.wait(job, timeout=120)

Known pitfalls handled here: munged must run as munge (and its socket directory must be
reachable by all); ``CgroupPlugin=cgroup/v1`` on hybrid cgroup hosts; ``NodeName=localhost``;
``proctrack/linuxproc`` and ``task/none`` (no cgroups, no systemd needed); small ``MinJobAge``.
"""
from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BINARIES = ("munged", "munge", "unmunge", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}


class SlurmUnavailable(RuntimeError):
    """The cluster cannot run here (not root, packages missing, daemons failed): tests skip."""


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be started here, or None when it can be tried."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "Slurm tests need Linux"
    if os.geteuid() != 0:
        return "Slurm tests need root (they start munged, slurmctld and slurmd)"
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return ("Slurm tests need the Debian packages slurm-wlm and munge "
                f"(missing: {', '.join(missing)}; `bash scripts/install.sh --test` as root installs them)")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "Slurm tests need the munge user (Debian package munge)"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cgroup_plugin() -> str:
    # pure cgroup v2 host: /sys/fs/cgroup/cgroup.controllers; else v1 or hybrid -> v1
    return "cgroup/v2" if Path("/sys/fs/cgroup/cgroup.controllers").exists() else "cgroup/v1"


class SlurmCluster:
    def __init__(self, root: str | os.PathLike, cpus: int = 8, min_job_age: int = 30, kill_wait: int = 20):
        self.root = Path(root).resolve()
        self.cpus = cpus
        self.min_job_age = min_job_age
        self.kill_wait = kill_wait
        self.conf = self.root / "slurm.conf"
        # jobs inherit this environment (sbatch --export=ALL): never the test process's own
        # launcher variables (a fixture may have run init_distributed in this process)
        self.env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
        self.env["SLURM_CONF"] = str(self.conf)
        self._procs: list[subprocess.Popen] = []
        self.munge_dir: Path | None = None
        self.munge_socket: Path | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> None:
        reason = unavailable_reason()
        if reason:
            raise SlurmUnavailable(reason)
        self._start_munge()
        self._write_config()
        ctld = subprocess.Popen([_which("slurmctld"), "-D", "-c", "-i"], env=self.env,
                                stdout=open(self.root / "slurmctld.out", "w"), stderr=subprocess.STDOUT)
        self._procs.append(ctld)
        self._wait_for(lambda: self._run(["scontrol", "ping"], check=False).returncode == 0
                       and "UP" in self._run(["scontrol", "ping"], check=False).stdout,
                       timeout, "slurmctld did not answer `scontrol ping`", ctld)
        slurmd = subprocess.Popen([_which("slurmd"), "-D", "-N", "localhost"], env=self.env,
                                  stdout=open(self.root / "slurmd.out", "w"), stderr=subprocess.STDOUT)
        self._procs.append(slurmd)
        self._wait_for(self._node_idle, timeout, "node localhost did not become idle", slurmd)

    def stop(self) -> None:
        if any(p.poll() is None for p in self._procs):
            # cancel what is left and give slurmd a moment to finish its job steps cleanly
            self._run(["scancel", "--user=root"], check=False)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (self._stepd_pids() or self._queue_not_empty()):
                time.sleep(0.3)
        for p in reversed(self._procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self._procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()
        # slurmstepd processes of this cluster that outlived their slurmd (e.g. the first attempt of a
        # requeued job still reporting to a controller that is gone) ignore SIGTERM: kill them
        for pid in self._stepd_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self._stop_munge()

    def _queue_not_empty(self) -> bool:
        try:
            res = self._run(["squeue", "-h", "-o", "%i"], check=False, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return False
        return res.returncode == 0 and bool(res.stdout.strip())

    def _stepd_pids(self) -> list[int]:
        """slurmstepd processes started by this cluster's slurmd (found by SLURM_CONF in their environment)."""
        mine = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if not (proc / "cmdline").read_bytes().startswith(b"slurmstepd"):
                    continue
                if mine in (proc / "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
            except OSError:
                continue
        return pids

    # -- munge --------------------------------------------------------------------------------
    def munge_works(self) -> bool:
        try:
            cred = subprocess.run([_which("munge"), "-S", str(self.munge_socket), "-n"], capture_output=True, timeout=10)
            if cred.returncode != 0:
                return False
            back = subprocess.run([_which("unmunge"), "-S", str(self.munge_socket)], input=cred.stdout,
                                  capture_output=True, timeout=10)
            return back.returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False

    def _start_munge(self) -> None:
        """A private munged (own key, own socket) so that nothing on the host is touched or shared:
        two test sessions can run side by side and stopping ours never breaks anybody else's."""
        munge = pwd.getpwnam("munge")
        d = Path(tempfile.mkdtemp(prefix="setdlm-munge-"))  # not under pytest's 0700 tmp: munge must reach it
        os.chown(d, munge.pw_uid, munge.pw_gid)
        os.chmod(d, 0o711)  # munged insists on execute permission for all on the socket directory
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chown(key, munge.pw_uid, munge.pw_gid)
        os.chmod(key, 0o400)
        self.munge_dir, self.munge_socket = d, d / "munge.sock"
        res = subprocess.run(
            ["runuser", "-u", "munge", "--", _which("munged"), f"--socket={self.munge_socket}",
             f"--key-file={key}", f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
             f"--seed-file={d / 'munged.seed'}"],
            capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            log = (d / "munged.log").read_text(errors="replace") if (d / "munged.log").exists() else ""
            raise SlurmUnavailable(f"munged did not start: {res.stderr.strip() or res.stdout.strip()}\n{log[-2000:]}")
        deadline = time.monotonic() + 15
        while not self.munge_works():
            if time.monotonic() > deadline:
                raise SlurmUnavailable("munged started but `munge -n | unmunge` fails")
            time.sleep(0.2)

    def _stop_munge(self) -> None:
        if self.munge_dir is None:
            return
        try:
            os.kill(int((self.munge_dir / "munged.pid").read_text().strip()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
        shutil.rmtree(self.munge_dir, ignore_errors=True)
        self.munge_dir = None

    # -- configuration ------------------------------------------------------------------------
    def _write_config(self) -> None:
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        r = self.root
        self.conf.write_text(f"""\
ClusterName=setdlmtest
SlurmctldHost=localhost
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MinJobAge={self.min_job_age}
KillWait={self.kill_wait}
InactiveLimit=0
SlurmdTimeout=120
MessageTimeout=30
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=localhost CPUs={self.cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
        (r / "cgroup.conf").write_text(f"CgroupPlugin={_cgroup_plugin()}\n")

    # -- helpers ------------------------------------------------------------------------------
    def _run(self, cmd: list[str], check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        cmd = [_which(cmd[0]), *cmd[1:]]
        res = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def _node_idle(self) -> bool:
        res = self._run(["sinfo", "-h", "-N", "-o", "%T"], check=False)
        return res.returncode == 0 and res.stdout.strip().startswith("idle")

    def _wait_for(self, cond, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if proc is not None and proc.poll() is not None:
                self.stop()
                raise SlurmUnavailable(f"{what}: daemon exited ({proc.returncode}).\n{self.logs_tail()}")
            try:
                if cond():
                    return
            except (OSError, subprocess.SubprocessError):
                pass
            if time.monotonic() > deadline:
                tail = self.logs_tail()
                self.stop()
                raise SlurmUnavailable(f"{what} within {timeout:.0f}s.\n{tail}")
            time.sleep(0.3)

    def logs_tail(self, n: int = 15) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"):
            p = self.root / name
            if p.exists():
                lines = p.read_text(errors="replace").splitlines()[-n:]
                out.append(f"--- {name}\n" + "\n".join(lines))
        return "\n".join(out)

    # -- jobs ---------------------------------------------------------------------------------
    def sbatch(self, script_and_args: list[str], extra: list[str] = (), env: dict | None = None,
               cwd: str | os.PathLike | None = None) -> str:
        cmd = [_which("sbatch"), "--parsable", *extra, *map(str, script_and_args)]
        res = subprocess.run(cmd, env={**self.env, **(env or {})}, capture_output=True, text=True,
                             timeout=60, cwd=cwd)
        if res.returncode != 0:
            raise RuntimeError(f"sbatch failed ({res.returncode}): {res.stderr.strip()}")
        return res.stdout.strip().split(";")[0]

    def job_info(self, job_id: str) -> dict[str, str]:
        res = self._run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if res.returncode != 0:
            return {}
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", res.stdout))

    def state(self, job_id: str) -> str:
        return self.job_info(job_id).get("JobState", "UNKNOWN")

    def wait(self, job_id: str, timeout: float = 300, states=TERMINAL, poll: float = 0.5) -> dict[str, str]:
        """Poll until the job reaches one of ``states``; returns its last ``scontrol show job``."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id) or info
            if info.get("JobState") in states:
                return info
            time.sleep(poll)
        self._run(["scancel", str(job_id)], check=False)
        raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout:.0f}s; "
                           f"cancelled.\n{self.logs_tail()}")

    def scancel(self, job_id: str, *args: str) -> None:
        self._run(["scancel", *args, str(job_id)])

    def scontrol(self, *args: str) -> str:
        return self._run(["scontrol", *map(str, args)]).stdout

    def release(self, job_id: str) -> None:
        """Start a requeued job now: Slurm otherwise holds it back (BeginTime) for about 2 minutes.

        Waits first until the previous attempt's slurmstepd processes are gone: a job released while
        its old batch step is still winding down is killed at launch ("Job credential revoked")."""
        deadline = time.monotonic() + 60
        while self._stepd_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        self.scontrol("update", f"JobId={job_id}", "StartTime=now")
