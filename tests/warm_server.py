"""The server behind tests/warm_start.py: imports what a training process imports, once, then
forks a child per request that runs a script as `python SCRIPT ARGS` would.

    python tests/warm_server.py SOCKET

A request is one JSON line on a new connection to SOCKET: {"argv": [script, args...], "env":
{...}, "cwd": ..., "stdout": path, "stderr": path or null (into stdout)}. The server answers the child's pid, and
later, on the same connection, its exit code as subprocess reports it (negative: killed by
that signal). It stays single-threaded, so that a fork copies no lock held by another
thread, and ends when the process that started it is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading

# What `python pretrain/main.py` imports before and during a run's set-up (9 of a tiny run's
# 11 s): torch, DeepSpeed, its engine's optimizer check (which imports inductor), dynamo
# (torch.optim's first optimizer), megatron-core's datasets, TensorBoard's writer.
import deepspeed  # noqa: F401
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
import torch._dynamo  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401
import torch.utils.tensorboard  # noqa: F401

import pretrain.cli.train  # noqa: F401
from pretrain.data.megatron_compat import import_quietly

for _module in ("gpt_dataset", "blended_megatron_dataset_builder", "indexed_dataset"):
    import_quietly(f"megatron.core.datasets.{_module}")


def _child(request: dict, keep_closed: list[int]) -> None:
    """Become the requested process; never returns."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in keep_closed:
        os.close(fd)
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        if request["stderr"] is None:  # stderr=subprocess.STDOUT
            err = os.dup(out)
        else:
            err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        # sys.path as `python SCRIPT` makes it: the script's folder, then PYTHONPATH's.
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = [p for p in extra if p not in sys.path]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        # What the interpreter does at its exit: wait for non-daemon threads, run atexit.
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve(path: str) -> None:
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while os.getppid() == parent:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is server:
                conn, _ = server.accept()
                with conn.makefile("r") as lines:
                    request = json.loads(lines.readline())
                pid = os.fork()
                if pid == 0:
                    _child(request, [server.fileno(), conn.fileno(), wake_r, wake_w])
                conn.sendall(f"{pid}\n".encode())
                waiting[pid] = conn
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
