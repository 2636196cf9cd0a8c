"""Every exit code a program of ours gives, named once.

Slurm scripts read them (`slurm/launch.sh` requeues on EXIT_PREEMPTED and EXIT_HUNG; a test
checks its copies against these), and `study status` reads them back from a run's exit
record, so each has exactly one meaning across the toolkit.
"""

from __future__ import annotations

EXIT_OK = 0
# A bug or a failure of the machine (a traceback, a failed disk); also a failed check.
EXIT_FAILED = 1
# A bad flag, file, field or path (pretrain/cli/errors.py): one line, no traceback.
EXIT_USER_ERROR = 2
# BSD's EX_TEMPFAIL: "run the command again" (the GPU check's stages left for a next call).
EXIT_MORE = 75
# A signal-triggered checkpoint was written (SIGTERM/SIGUSR1); requeue and it resumes.
EXIT_PREEMPTED = 99
# The hang watchdog ended the run: no step completed within train.hang_timeout. 124 is what
# GNU `timeout` gives a command that ran out of time, so it reads as a timeout in any shell
# log; above 99 and 1, so that srun, which reports the highest exit code of its tasks,
# reports it even when a rank whose collective failed under it exits 1; below 128, so it
# never reads as a death by signal.
EXIT_HUNG = 124
# 128 + SIGKILL: what a test's kill point (pretrain/faults.py) ends with, as kill -9 would.
EXIT_KILLED = 137
