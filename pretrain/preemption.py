"""Preemption: turn SIGTERM, Ctrl-C (SIGINT) and the Slurm warning signal into a save at the next step.

Slurm sends ``SIGUSR1`` some time before the end of a job's time limit when the job was submitted
with ``--signal=USR1@120`` (the batch template does), and ``SIGTERM`` (then ``SIGKILL`` after
``KillWait``) when the job is cancelled or preempted. Signals reach some ranks and not others, or
at different moments, so the handler only records the signal; :meth:`PreemptionHandler.should_stop`
agrees across ranks with one all-reduce every N steps (train.preemption_check_every), and the
trainer does::

    handler = PreemptionHandler(); handler.install()
    for step in ...:
        ...
        if handler.should_stop(step, every=N):
            save_checkpoint(...)
            handler.requeue()   # Slurm: scontrol requeue $SLURM_JOB_ID (rank 0); no-op elsewhere
            sys.exit(0)

The save at a signal is a blocking one: it first waits for a checkpoint still being written in the
background (pretrain/checkpoint/writer.py), then writes and publishes its own, so nothing exits (and
Slurm requeues nothing) before every write has ended. The requeued job starts the same batch script
again, the trainer finds the run directory (derived from the run name) and resumes from its last
checkpoint, under whatever number of nodes it got.

Ctrl-C (SIGINT) is handled like SIGTERM; a second Ctrl-C exits at once (status 130; the last complete
checkpoint is untouched because checkpoints are published atomically: a write it cuts short is never
published, and the next start removes it). `setdlm pretrain` installs the
handler (:func:`active_handler`) before it imports torch or creates the process group, so a signal
that arrives during start-up is recorded and honoured at the first step boundary after set-up; rank 0
says so at once, on one line ("stopping after set-up"), until the trainer calls :meth:`end_setup`.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from typing import Iterable

from common.env import env_rank as _env_rank
from common.log import get_logger

log = get_logger("setdlm.preemption")

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class PreemptionHandler:
    """Record preemption signals; agree across ranks at step boundaries; requeue under Slurm."""

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS):
        self.signals = tuple(signal.Signals(s) for s in signals)
        self._received: int | None = None  # first signal number seen by this process
        self._received_at: float | None = None
        self._previous: dict[int, object] = {}
        self._stop = False  # sticky: once agreed, stays True
        self._installed = False
        self._setting_up = True  # until end_setup(): a signal is honoured after set-up, and says so
        self._rank = _env_rank()

    # -- installation -------------------------------------------------------------------------
    def install(self) -> "PreemptionHandler":
        if self._installed:
            return self
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler.install() must be called from the main thread")
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        self._installed = True
        return self

    def uninstall(self) -> None:
        if not self._installed:
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        self._installed = False

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        # Only record: no I/O, no collectives, no locks inside a signal handler.
        if self._received is None:
            self._received = signum
            self._received_at = time.monotonic()
            if self._setting_up:
                if self._rank == 0:
                    os.write(2, f"\nsetdlm: {signal.Signals(signum).name} during start-up: stopping after set-up "
                                "(a checkpoint is saved at the first step)\n".encode())
            elif signum == signal.SIGINT:
                os.write(2, b"\nCtrl-C: saving a checkpoint at the end of this step (Ctrl-C again to exit now)\n")
        elif signum == signal.SIGINT:  # a second Ctrl-C: leave now, without the save
            os.write(2, b"\nCtrl-C again: exiting without saving (the last complete checkpoint is kept)\n")
            os._exit(130)

    def end_setup(self) -> None:
        """Set-up is over (the training loop starts): a signal from now on stops at the step's end."""
        self._setting_up = False

    # -- queries ------------------------------------------------------------------------------
    @property
    def received(self) -> int | None:
        """The signal number this process received first, or None."""
        return self._received

    def trigger(self, signum: int = signal.SIGTERM) -> None:
        """Act as if ``signum`` had arrived (tests, or a trainer that wants a clean stop)."""
        self._on_signal(signum, None)

    def should_stop(self, step: int | None = None, every: int = 1) -> bool:
        """True on every rank if any rank got a signal. With more than one rank the ranks agree by one
        all-reduce over the default group, which waits for the host: it runs only at steps that are
        multiples of `every` (and whenever `step` is None), so a signal is honoured within `every`
        steps and the other steps never wait (train.preemption_check_every). Call it at step
        boundaries only, with the same arguments on every rank. One process needs no agreement: its
        own flag is read every step, for free."""
        if self._stop:
            return True
        local = self._received is not None
        agreed = local
        if step is not None and step % max(1, every) and self._world() > 1:
            return False  # not a checking step: no collective, no wait
        try:
            import torch
            import torch.distributed as dist
        except ImportError:  # pragma: no cover - torch is a hard dependency
            dist = None
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = "cpu"
            if dist.get_backend() == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            agreed = bool(flag.item())
        if agreed:
            self._stop = True
            if local:
                log.warning("preemption: received %s, stopping at this step boundary",
                            signal.Signals(self._received).name)
            else:
                log.warning("preemption: another rank received a signal, stopping at this step boundary")
        return agreed

    @staticmethod
    def _world() -> int:
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover
            return 1
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    # -- requeue ------------------------------------------------------------------------------
    def requeue(self) -> None:
        """Under Slurm, requeue this job so that it starts again and resumes from the checkpoint.

        All ranks call it after the checkpoint is saved; it waits at a barrier (so nothing is
        killed mid-write when Slurm stops the job), then rank 0 runs ``scontrol requeue
        $SLURM_JOB_ID``. No-op outside Slurm, or when ``SETDLM_NO_REQUEUE=1``. A failure to
        requeue (job submitted with ``--no-requeue``, an ``srun`` outside ``sbatch``) is logged,
        not raised: the checkpoint is already safe.
        """
        job_id = os.environ.get("SLURM_JOB_ID")
        if not job_id or os.environ.get("SETDLM_NO_REQUEUE", "0") not in ("", "0"):
            return
        rank = 0
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank()
                if dist.get_world_size() > 1:
                    dist.barrier()
            else:
                rank = _env_rank()
        except Exception as err:  # noqa: BLE001 - requeue must never crash a clean stop
            log.warning("preemption: could not synchronise before requeue (%s)", err)
        if rank != 0:
            return
        scontrol = shutil.which("scontrol")
        if scontrol is None:
            log.warning("preemption: scontrol not found, job %s not requeued", job_id)
            return
        try:
            res = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True, timeout=60)
        except (subprocess.SubprocessError, OSError) as err:
            log.warning("preemption: scontrol requeue %s failed: %s", job_id, err)
            return
        if res.returncode != 0:
            log.warning("preemption: scontrol requeue %s failed (rc=%d): %s",
                        job_id, res.returncode, (res.stderr or res.stdout).strip())
        else:
            log.warning("preemption: job %s requeued", job_id)


_ACTIVE: PreemptionHandler | None = None


def active_handler() -> PreemptionHandler:
    """The process's installed handler, installing one on first call (main thread only). The CLI calls
    it before set-up so early signals are kept; the trainer calls it again and gets the same one."""
    global _ACTIVE
    if _ACTIVE is None or not _ACTIVE._installed:
        _ACTIVE = PreemptionHandler().install()
    return _ACTIVE


def release_handler() -> None:
    """Uninstall the active handler (end of training): signals get their previous meaning back."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.uninstall()
        _ACTIVE = None


__all__ = ["PreemptionHandler", "DEFAULT_SIGNALS", "active_handler", "release_handler"]
