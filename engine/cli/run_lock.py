"""One run at a time in a run directory: a run claims `trainer.default_root_dir` with an exclusive lock on
`<default_root_dir>/run.lock` (`fcntl.flock`) before it writes anything there, and holds it until it ends. A second
run into the same directory, started while the first one lives, ends with one error line naming the directory and
the process that holds it. The operating system drops the lock when that process ends, however it ends (a `kill -9`
included), so a lock left by a dead run is taken over without a word. Only the global rank 0 claims the directory:
the other processes of a multi-GPU run write there through it."""

import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from engine.files import WriteFailed

LOCK_FILE = "run.lock"


class RunDirectoryInUse(RuntimeError):
    """Another living process runs in this directory."""


class RunDirectoryLock:
    def __init__(self, root: str | os.PathLike):
        self.path = Path(root) / LOCK_FILE
        self.descriptor: int | None = None

    def acquire(self) -> None:
        """Claim the directory, or raise `RunDirectoryInUse` naming the process that holds it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:  # a read-only or foreign directory: nothing of the run could be written there
            raise WriteFailed(f"trainer.default_root_dir '{self.path.parent}' cannot be written: {error.strerror or error}") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(descriptor, 4096).decode(errors="replace").strip() or "a process that has not yet said which"
            os.close(descriptor)
            raise RunDirectoryInUse(
                f"trainer.default_root_dir '{self.path.parent}' is in use by another run ({holder}): wait for it to end, "
                "or give this run another trainer.default_root_dir"
            ) from None
        except OSError as error:  # a filesystem without locks (Lustre mounted without `flock`)
            os.close(descriptor)
            rank_zero_warn(f"{self.path} cannot be locked ({error.strerror}): a second run into this directory would not be detected")
            return
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(descriptor, 0)
        job = f" (slurm job {os.environ['SLURM_JOB_ID']})" if os.environ.get("SLURM_JOB_ID") else ""  # the other ranks of the job know it by it
        os.write(descriptor, f"process {os.getpid()} on {socket.gethostname()}{job}, started {started}: {' '.join(sys.argv)}\n".encode())
        self.descriptor = descriptor

    def release(self) -> None:
        if self.descriptor is not None:
            os.close(self.descriptor)  # closing the file drops the lock; the file stays, unlocked
            self.descriptor = None
