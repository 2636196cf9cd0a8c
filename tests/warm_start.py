"""Training processes for the tests, forked from one warm interpreter instead of started cold.

A tiny training run in the tests takes ~11 s on 2 cores, ~9 s of it importing torch,
DeepSpeed, inductor and megatron-core (cProfile), and every training, checkpoint, resharding
and watchdog test starts such processes. A `WarmProcess` asks one server
(tests/warm_server.py, started at first use, gone with the pytest process) that has imported
those once to fork a child that runs the script:
an ordinary process with its own pid, argv, environment, working directory, output files,
signals and exit code, which runs `pretrain/main.py` as `python pretrain/main.py` does
after its imports. What differs from a cold start: module-level state is the server's (its
environment is child_env's; a launch's own variables are set before the script runs, and
the trainer reads its variables at run time), and the interpreter's start-up is not run
(sys.path is made as it makes it: the script's folder, then PYTHONPATH's entries; the other
PYTHON* variables are the server's).

`run_ranks` is `subprocess.run` for one process and torchrun for N ranks on this host:
the rank variables of each, and when a rank fails the others get SIGTERM, then SIGKILL
after 30 s, and the launch reports 1 (torchrun's agent does the same). The real launchers
stay tested: torchrun in tests/test_train_parallel.py and the Slurm reference, srun and
DeepSpeed's launcher on the local Slurm cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVER = Path(__file__).with_name("warm_server.py")
_server: dict[str, object] = {}


def _socket_path(env: dict[str, str]) -> str:
    if not _server:
        folder = tempfile.mkdtemp(prefix="warm_")
        path = os.path.join(folder, "socket")
        proc = subprocess.Popen([sys.executable, str(SERVER), path], env=env)
        deadline = time.monotonic() + 120
        while not os.path.exists(path):
            if proc.poll() is not None:
                raise RuntimeError(f"tests/warm_server.py exited with {proc.returncode}")
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("tests/warm_server.py did not start in 120 s")
            time.sleep(0.05)
        _server.update(proc=proc, path=path)
        atexit.register(shutil.rmtree, folder, True)
        atexit.register(proc.kill)  # runs first (last registered)
    return str(_server["path"])


class WarmProcess:
    """The part of subprocess.Popen the tests use, for a child of the warm server. `stderr`
    None: into `stdout`'s file, as stderr=subprocess.STDOUT."""

    def __init__(
        self, argv: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path | None
    ):
        self.args = argv
        self.returncode: int | None = None
        self._buffer = b""
        base = {k: v for k, v in env.items() if k not in _PER_LAUNCH}
        base = {k: v for k, v in base.items() if not k.startswith("PRETRAIN_")}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(_socket_path(base))
        request = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": str(stdout)}
        request["stderr"] = None if stderr is None else str(stderr)
        self._sock.sendall((json.dumps(request) + "\n").encode())
        self.pid = int(self._line(None))

    def _line(self, timeout: float | None) -> str:
        """The server's next line; '' when `timeout` passes first (0: do not wait)."""
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if end is None else max(0.0, end - time.monotonic())
            if left is not None and not select.select([self._sock], [], [], left)[0]:
                return ""
            chunk = self._sock.recv(64)
            if not chunk:
                raise RuntimeError(f"the warm server lost process {self.args}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(0)
            if line:
                self._finish(line)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if not line:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._finish(line)
        return self.returncode

    def _finish(self, line: str) -> None:
        self.returncode = int(line)
        self._sock.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


# Variables a launch sets for itself; the rest is the server's environment.
_PER_LAUNCH = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_vars(rank: int, nproc: int, port: str) -> dict[str, str]:
    """A rank's launcher variables on this host, as srun's tasks get them."""
    ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc)}
    return {**ranks, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}


def run_ranks(
    argv: list[str], env: dict[str, str], cwd: Path, timeout: float, nproc: int
) -> subprocess.CompletedProcess:
    """`nproc` ranks of `python SCRIPT ...` on this host, as torchrun starts them; their
    outputs joined in rank order. One process: its own exit code; several: 0 or 1."""
    with tempfile.TemporaryDirectory(prefix="warm_out_") as folder:
        out = Path(folder)
        ranks = []
        port = str(free_port())
        for rank in range(nproc):
            rank_env = dict(env)
            if nproc > 1:  # torchrun's: srun's and the node's rank count
                rank_env.update(rank_vars(rank, nproc, port), LOCAL_WORLD_SIZE=str(nproc))
            ranks.append(WarmProcess(argv, rank_env, cwd, out / f"{rank}.out", out / f"{rank}.err"))
        deadline = time.monotonic() + timeout
        try:
            _wait_like_torchrun(ranks, deadline)
        except subprocess.TimeoutExpired:
            for p in ranks:
                p.kill()
            for p in ranks:
                p.wait(30)
            raise subprocess.TimeoutExpired(argv, timeout) from None
        codes = [p.returncode for p in ranks]
        stdout = "".join((out / f"{r}.out").read_text(errors="replace") for r in range(nproc))
        stderr = "".join((out / f"{r}.err").read_text(errors="replace") for r in range(nproc))
    code = codes[0] if nproc == 1 else int(any(codes))
    return subprocess.CompletedProcess(argv, code, stdout, stderr)


def _wait_like_torchrun(ranks: list[WarmProcess], deadline: float) -> None:
    stop_at = None
    while any(p.poll() is None for p in ranks):
        now = time.monotonic()
        if now > deadline:
            raise subprocess.TimeoutExpired([], 0)
        failed = any(p.returncode not in (None, 0) for p in ranks)
        if failed and stop_at is None:
            stop_at = now + 30
            for p in ranks:
                p.terminate()
        if stop_at is not None and now > stop_at:
            for p in ranks:
                p.kill()
        time.sleep(0.05)
