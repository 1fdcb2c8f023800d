"""A warm vLLM process: imports vLLM once, then forks a child per job that runs one of the runners beside this file.

Runs inside the vLLM venv, executed by path (stdlib and vllm only, as the runners). Why: importing vLLM costs
about 8 s of one core before any engine starts, and the test suite starts many; a fork of this
process starts where the import ended. Opt-in (engines/vllm/warm_launch.py: EAGLE3_HF_VLLM_WARM); without it every
runner is its own process, as users run them.

    python vllm_warm.py SOCKET

Protocol, one job per connection on the Unix socket: the caller sends one JSON line {"python": the interpreter it
would run, "argv": [script, args...], "env": {...}, "cwd": str, "new_session": bool} with three file descriptors
(stdin, stdout, stderr) attached. This process answers {"cold": [keys]} when the job's environment differs from its
own in a variable that a library may have read while importing (the Hub's endpoint and offline mode, vLLM's
settings; the caller then starts a fresh process), else {"pid": N} once forked and {"status": S} when the child
exits (S as subprocess.Popen.returncode: negative for a signal). A caller that closes the connection early leaves
the child running (the caller kills it by pid as it would its own child). The CPU seconds of the children reaped so
far are in SOCKET.cpu (the test suite's per-test CPU table reads them: these children are not its own).
"""

from __future__ import annotations

import json
import os
import runpy
import selectors
import signal
import socket
import sys
import traceback


def warm_up() -> None:
    """What every runner imports before its own work: this is the time a fork saves."""
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401
    from vllm.v1.engine import core  # noqa: F401


# What a job's environment may change: read by the runners themselves, or by nothing vLLM imports.
RUN_TIME_VARIABLES = {"OMP_NUM_THREADS", "PYTHONPATH", "VLLM_API_KEY"}
RUN_TIME_PREFIXES = ("EAGLE3_HF_", "PYTEST_")


def import_time_differences(env: dict[str, str], own: dict[str, str], set_by_import: dict[str, str]) -> list[str]:
    """The variables where `env` and this process's start differ and that an import may have read already;
    a variable vLLM's import sets itself (`set_by_import`) differs only when the job gives it another value."""
    def differs(key: str) -> bool:
        if key in RUN_TIME_VARIABLES or key.startswith(RUN_TIME_PREFIXES):
            return False
        if key in set_by_import and env.get(key) in (None, set_by_import[key]):
            return False
        return env.get(key) != own.get(key)

    return sorted(k for k in set(env) | set(own) if differs(k))


def child(header: dict, fds: list[int]) -> None:
    """In the forked child: become the runner process the caller asked for, then exit with its status."""
    status = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):  # the runner's own, as a fresh process has
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        if header.get("new_session"):
            os.setsid()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(header["cwd"])
        os.environ.clear()
        os.environ.update(header["env"])
        script = header["argv"][0]
        extra = [p for p in header["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(os.path.abspath(script)), *extra, *sys.path[1:]]
        sys.argv = list(header["argv"])
        threads = header["env"].get("OMP_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exc:
        code = exc.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if not isinstance(code, (int, type(None))):
            print(code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(status)


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One job: a JSON line and the three descriptors sent with its first bytes."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            raise ConnectionError("the caller left before sending its job")
        data += more
    return json.loads(data), list(fds)


def serve(path: str) -> None:
    own = dict(os.environ)
    warm_up()
    set_by_import = {k: v for k, v in os.environ.items() if own.get(k) != v}
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    waiting: dict[int, socket.socket] = {}  # child pid -> its caller's connection
    cpu_seconds = 0.0
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    try:
        while True:
            for _key, _ in selector.select(timeout=0.05):
                conn, _ = server.accept()
                try:
                    header, fds = receive(conn)
                except (OSError, ValueError, ConnectionError):
                    conn.close()
                    continue
                differ = import_time_differences(header["env"], own, set_by_import)
                if header.get("python") != sys.executable:
                    differ.append(f"the interpreter ({header.get('python')})")
                if differ:
                    for fd in fds:
                        os.close(fd)
                    print(f"cold start: {', '.join(differ)} differ", file=sys.stderr, flush=True)
                    send(conn, {"cold": differ})
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:  # the child keeps none of this process's sockets (another caller's EOF stays theirs)
                    selector.close()
                    for sock in (server, conn, *waiting.values()):
                        sock.close()
                    child(header, fds)
                for fd in fds:
                    os.close(fd)
                waiting[pid] = conn
                send(conn, {"pid": pid})
            while waiting:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
                if pid == 0:
                    break
                cpu_seconds += usage.ru_utime + usage.ru_stime
                write_total(path + ".cpu", cpu_seconds)
                if pid in waiting:
                    caller = waiting.pop(pid)
                    send(caller, {"status": os.waitstatus_to_exitcode(status)})
                    caller.close()
    finally:
        server.close()
        for name in (path, path + ".cpu"):
            if os.path.exists(name):
                os.unlink(name)


def write_total(path: str, seconds: float) -> None:
    with open(path + ".part", "w", encoding="utf-8") as out:
        out.write(f"{seconds:.3f}\n")
    os.replace(path + ".part", path)


def send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:  # the caller went away: its child runs on, and is reaped all the same
        pass


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    serve(sys.argv[1])
