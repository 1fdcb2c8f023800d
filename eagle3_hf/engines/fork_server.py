"""A warm process: imports what its jobs import once, then forks a child per job that becomes the process asked for.

Executed by path with the standard library only, inside the venv its jobs run in: vLLM's for the vLLM runners
(engines/vllm/warm_launch.py), the project's own for `eagle3-hf` commands and the training script
(engines/forked.py). Why: a vLLM runner spends about 8 s of one core importing vLLM, and a command about 3 s
importing torch and transformers, before its own work; the test suite starts hundreds. A fork of this process
starts where the imports ended. Opt-in: without a warm process every job is its own process, as users run them.

    python fork_server.py SOCKET [--warm NAME ...] [--run-time-variables NAME ...]

NAME to warm: a module to import, or `module:attribute` (imported from it). Run-time variables: environment
variables a job may set to another value than this process's, because nothing imported here has read them
(`PREFIX*` names a prefix; `EAGLE3_HF_*`, `PYTEST_*` and a shell's own always are).

Protocol, one job per connection on the Unix socket: the caller sends one JSON line {"python": the interpreter it
would run, "run": {"path": script} or {"module": name}, "argv": [argv0, args...], "env": {...}, "cwd": str,
"new_session": bool, "tied": bool, "flags": [...], "unbuffered": bool} with three file descriptors (stdin, stdout,
stderr) attached.
This process answers {"cold": [reasons]} when it cannot be that process (the environment differs in a variable an
import may have read, another interpreter, other interpreter flags: the caller then starts a fresh process), else
{"pid": N} once forked and {"status": S} when the child exits (S as subprocess.Popen.returncode: negative for a
signal). A caller that closes the connection early leaves the child running, unless the job is `tied`: then the
child stands for the caller itself (engines/forked.py), and dies with its process group when the caller's end of
the connection closes, as a process killed with its group would. The CPU seconds of the children reaped so far are
in SOCKET.cpu (the test suite's per-test CPU table reads them: these children are not its own).
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback

RUN_TIME_PREFIXES = ("EAGLE3_HF_", "PYTEST_")
SHELL_VARIABLES = {"_", "PWD", "OLDPWD", "SHLVL"}  # what a shell sets for each command it starts


def warm_up(names: list[str]) -> None:
    """What every job imports before its own work: this is the time a fork saves."""
    for name in names:
        module, _, attribute = name.partition(":")
        imported = importlib.import_module(module)
        if attribute:
            getattr(imported, attribute)


def interpreter_flags() -> list:
    """The command-line options of the interpreter a job would run under (`-O`, `-B`, `-W`, `-X`, ...; `-u` travels
    as the job's `unbuffered`: the fork sets up its own streams)."""
    return [list(sys.flags), sorted(sys.warnoptions), sorted(str(item) for item in sys._xoptions.items())]


def import_time_differences(env: dict[str, str], own: dict[str, str], set_by_import: dict[str, str],
                            run_time: set[str]) -> list[str]:
    """The variables where `env` and this process's start differ and that an import may have read already;
    a variable an import sets itself (`set_by_import`) differs only when the job gives it another value."""
    prefixes = RUN_TIME_PREFIXES + tuple(name[:-1] for name in run_time if name.endswith("*"))

    def differs(key: str) -> bool:
        if key in run_time or key in SHELL_VARIABLES or key.startswith(prefixes):
            return False
        if key in set_by_import and env.get(key) in (None, set_by_import[key]):
            return False
        return env.get(key) != own.get(key)

    return sorted(k for k in set(env) | set(own) if differs(k))


def _std_stream(fd: int, write: bool, unbuffered: bool) -> io.TextIOWrapper:
    """sys.stdin/stdout/stderr over `fd`, buffered as a fresh interpreter buffers them (PYTHONUNBUFFERED, `-u`)."""
    raw = io.FileIO(fd, "w" if write else "r", closefd=False)
    interactive = raw.isatty()
    buffered = io.BufferedWriter(raw) if write else io.BufferedReader(raw)
    return io.TextIOWrapper(buffered, errors="backslashreplace" if fd == 2 else None,
                            line_buffering=interactive or fd == 2, write_through=write and unbuffered)


def _die_with_caller(conn: socket.socket) -> None:
    """A tied job: the caller sends nothing after its job, so a read returns only when its end closes (it exited,
    or was killed): then this child and its process group go too."""
    try:
        while conn.recv(4096):
            pass
    except OSError:
        pass
    os.killpg(os.getpgrp(), signal.SIGKILL)


def child(header: dict, fds: list[int], conn: socket.socket) -> None:
    """In the forked child: become the process the caller asked for, then exit with its status."""
    status = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGCHLD):  # the job's own, as a fresh process has them
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if header.get("new_session") or header.get("tied"):
            os.setsid()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(header["cwd"])
        os.environ.clear()
        os.environ.update(header["env"])
        os.environ["EAGLE3_HF_WARM_JOB"] = str(os.getpid())  # engines/forked.py: this process runs here, not again
        unbuffered = bool(header.get("unbuffered") or os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin, sys.stdout, sys.stderr = (_std_stream(0, False, False), _std_stream(1, True, unbuffered),
                                             _std_stream(2, True, unbuffered))
        if header.get("tied"):
            threading.Thread(target=_die_with_caller, args=(conn,), daemon=True).start()
        else:
            conn.close()
        run = header["run"]
        extra = [p for p in header["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        first = os.path.dirname(os.path.abspath(run["path"])) if "path" in run else os.getcwd()
        sys.path[:] = [first, *extra, *sys.path[1:]]
        sys.argv = list(header["argv"])
        _reseed()
        threads = header["env"].get("OMP_NUM_THREADS")
        if threads and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))
        if "path" in run:
            runpy.run_path(run["path"], run_name="__main__")
        else:  # as `python -m`: the module runs as __main__, not also as itself (imported here while warming up)
            sys.modules.pop(run["module"], None)
            runpy.run_module(run["module"], run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as exc:
        code = exc.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if not isinstance(code, (int, type(None))):
            print(code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        _finish()
        os._exit(status)


def _reseed() -> None:
    """A fresh process draws its own seeds; a fork inherits this process's (Python's `random` reseeds itself)."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _finish() -> None:
    """What a fresh interpreter does at exit: wait for its threads, run its exit handlers, flush its streams."""
    for step in (getattr(threading, "_shutdown", None), getattr(__import__("atexit"), "_run_exitfuncs", None)):
        try:
            if step is not None:
                step()
        except BaseException:
            traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One job: a JSON line and the three descriptors sent with its first bytes."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            raise ConnectionError("the caller left before sending its job")
        data += more
    return json.loads(data), list(fds)


def shadowed(python_path: str) -> list[str]:
    """Modules imported here that a job's PYTHONPATH would have it import from elsewhere (a fresh process would
    load the other file), and start-up hooks it holds: the variable may differ when it has none of them."""
    found = []
    for entry in filter(None, python_path.split(os.pathsep)):
        try:
            names = os.listdir(entry)
        except OSError:
            continue
        for name in names:
            if name in ("sitecustomize.py", "usercustomize.py"):  # a fresh interpreter runs it first
                found.append(f"{name} in PYTHONPATH's {entry}")
                continue
            module = sys.modules.get(name[:-3] if name.endswith(".py") else name)
            where = getattr(module, "__file__", None)
            if where and not os.path.abspath(where).startswith(os.path.join(os.path.abspath(entry), "")):
                found.append(f"{name} in PYTHONPATH's {entry}")
    return found


def refusals(header: dict, own: dict[str, str], set_by_import: dict[str, str], run_time: set[str]) -> list[str]:
    """Why this process cannot be the job's process (empty: it can)."""
    env = header["env"]
    differ = import_time_differences(env, own, set_by_import, run_time | {"PYTHONPATH"})
    if env.get("PYTHONPATH") != own.get("PYTHONPATH") and "PYTHONPATH" not in run_time:
        differ += shadowed(env.get("PYTHONPATH", ""))
    if header.get("python") != sys.executable:
        differ.append(f"the interpreter ({header.get('python')})")
    if header.get("flags", interpreter_flags()) != interpreter_flags():
        differ.append("the interpreter's options")
    return differ


def serve(path: str, warm: list[str], run_time: set[str]) -> None:
    own = dict(os.environ)
    warm_up(warm)
    set_by_import = {k: v for k, v in os.environ.items() if own.get(k) != v}
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    waiting: dict[int, socket.socket] = {}  # child pid -> its caller's connection
    cpu_seconds = 0.0
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    parent = os.getppid()
    try:
        while os.getppid() == parent:  # whoever started it is gone (a test worker that crashed): so is it
            for _key, _ in selector.select(timeout=0.05):
                conn, _ = server.accept()
                try:
                    header, fds = receive(conn)
                except (OSError, ValueError, ConnectionError):
                    conn.close()
                    continue
                differ = refusals(header, own, set_by_import, run_time)
                if differ:
                    for fd in fds:
                        os.close(fd)
                    print(f"cold start: {', '.join(differ)} differ", file=sys.stderr, flush=True)
                    send(conn, {"cold": differ})
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:  # the child keeps none of this process's sockets but its own caller's
                    selector.close()
                    for sock in (server, *waiting.values()):
                        sock.close()
                    child(header, fds, conn)
                for fd in fds:
                    os.close(fd)
                waiting[pid] = conn
                send(conn, {"pid": pid})
                print(f"forked {pid}: {' '.join(os.path.basename(a) for a in header['argv'][:2])}", file=sys.stderr,
                      flush=True)
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
    except OSError:  # the caller went away: its child runs on (or dies with it, if tied), and is reaped all the same
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("socket")
    parser.add_argument("--warm", nargs="*", default=[])
    parser.add_argument("--run-time-variables", nargs="*", default=[])
    options = parser.parse_args()
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this file's folder (the package's engines/, whose vllm/ is not vLLM) is no job's
    serve(options.socket, options.warm, set(options.run_time_variables))
