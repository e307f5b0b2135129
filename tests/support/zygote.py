"""Worker processes forked from one that has already imported the worker.

A worker's start is mostly its imports (torch, numba, FastAPI) and the load of its
compiled kernels: about 2.4 s of CPU, paid again by every worker a test starts. A
zygote pays them once per test process; each worker is then a fork of it that runs
``framewire serve`` exactly as ``python -m framewire.service serve`` would (same argv
parsing, settings, sockets, signals and exit status), in the test's environment and
directory. A test that needs what only a fresh interpreter gives (another PYTHONPATH,
other libraries) gets ``python -m framewire.service`` as before: ``start_worker``
chooses. The engines' drivers (tests/support/engine_site.py), which run in their own
sites, fork from a zygote of theirs that has imported torch and a few libraries
(``torch_zygote``; nothing of framewire's or the engine's). A script forked to run (a
benchmark) is handed a zygote of its own, forked from it just before the script starts,
so that the workers it starts are forks as well.

The zygote is the test process's child and each worker the zygote's: the zygote reaps
them and reports their exit status on its stdout, so ``Forked`` answers what a
``subprocess.Popen`` does for a worker (``pid``, ``poll``, ``wait``, ``send_signal``,
``kill``, ``returncode``).

A run on several pytest processes (pytest-xdist) preloads the worker's zygote once:
the controller starts it (``Shared``) listening on a Unix socket, and each process that
connects is served by a fork of it made for that connection (a session), which then
does all the above over the socket instead of pipes (``share``; tests/conftest.py).

Run as a script (``python -P zygote.py``), this file is the zygote; it imports nothing
of the tests.
"""

from __future__ import annotations

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
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

# Environment variables an interpreter reads as it starts or imports: a worker that is
# given other values than the zygote started with is started afresh.
AT_START = ("PYTHON", "LD_", "NUMBA_", "OMP_", "MKL_", "TORCH", "CUDA_", "MALLOC_")


def start_variables(env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables of ``env`` (os.environ) that an interpreter reads as it starts."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k.startswith(AT_START)}


class Forked:
    """A worker forked by the zygote, as much of ``subprocess.Popen`` as tests use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self._zygote = zygote
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._zygote.wait_exit(self.pid, left)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """A zygote of the test process: started once, lives as long as the test process.
    ``preload`` is what it imports first: ``"worker"`` (the worker's modules and kernels)
    or ``"torch"``; ``env`` the environment it starts in (the test process's)."""

    def __init__(
        self,
        preload: str = "worker",
        env: dict[str, str] | None = None,
        handed: tuple[int, int, int] | None = None,
        shared: str | None = None,
    ) -> None:
        self.env = dict(os.environ if env is None else env)
        self._gone = False
        self._conn: socket.socket | None = None
        if shared is not None:  # a session of the run's zygote; its hello names its env
            self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._conn.connect(shared)
            self._requests, self._answers = self._conn.makefile("wb"), self._conn.makefile("rb")
            self.alive: Callable[[], bool] = lambda: not self._gone
        elif handed is None:
            proc = subprocess.Popen(
                [sys.executable, "-P", __file__, preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=self.env,
            )
            assert proc.stdin is not None and proc.stdout is not None
            self._requests, self._answers = proc.stdin, proc.stdout
            self.alive = lambda: proc.poll() is None
        else:  # the one this script's fork was handed (_hand_over): its pid and pipes
            pid, requests, answers = handed
            self._requests, self._answers = open(requests, "wb"), open(answers, "rb")  # noqa: SIM115
            self.alive = lambda: _running(pid)
        self._lock = threading.Lock()  # one request at a time
        self._changed = threading.Condition()
        self._started: list[int | str] = []
        self._exits: dict[int, int] = {}
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()
        self._wait_started(timeout=120)  # "ready": its imports are done

    def can_start(self, env: dict[str, str] | None) -> bool:
        if not self.alive():
            return False
        return start_variables(env) == start_variables(self.env)

    def start(
        self,
        args: list[str],
        log: Path,
        env: dict[str, str] | None,
        cwd: Path | None,
        stdio: tuple[str, str, str] | None = None,
        script: Path | None = None,
        module: str | None = None,
    ) -> Forked:
        """Fork ``framewire ARGS`` (or ``python SCRIPT ARGS``, ``python -m MODULE ARGS``):
        stdout and stderr to ``log``, stdin /dev/null, unless ``stdio`` names the paths
        its descriptors 0, 1 and 2 open (a terminal's, say)."""
        request = {
            "argv": args,
            "script": None if script is None else str(script),
            "module": module,
            "stdio": list(stdio or (os.devnull, str(log), str(log))),
            "env": dict(os.environ if env is None else env),
            "cwd": str(cwd or os.getcwd()),
        }
        with self._lock:
            self._requests.write(json.dumps(request).encode() + b"\n")
            self._requests.flush()
            pid = self._wait_started(timeout=30)
        return Forked(self, pid, args)

    def close(self) -> None:
        """Let go of it: a session (or zygote) whose requests end leaves its workers be."""
        with self._lock:
            self._requests.close()
            if self._conn is not None:  # its reader still holds the socket: end the requests
                self._conn.shutdown(socket.SHUT_WR)

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits, timeout)

    def _wait_started(self, timeout: float) -> int:
        with self._changed:
            if not self._changed.wait_for(lambda: self._started, timeout):
                raise RuntimeError("the zygote did not answer")
            answer = self._started.pop(0)
        if isinstance(answer, str):
            raise RuntimeError(f"the zygote could not start a worker: {answer}")
        return answer

    def _read(self) -> None:
        for line in self._answers:
            event = json.loads(line)
            with self._changed:
                if "env" in event:  # a session's hello: the start variables it has
                    self.env = event["env"]
                if "exited" in event:
                    self._exits[event["exited"]] = event["code"]
                else:
                    self._started.append(event.get("started", event.get("error", "?")))
                self._changed.notify_all()
        with self._changed:  # the zygote is gone: so is every worker it had
            self._gone = True
            self._started.append("the zygote exited")
            self._changed.notify_all()


def _running(child: int) -> bool:
    try:
        return os.waitpid(child, os.WNOHANG)[0] == 0
    except ChildProcessError:  # reaped already
        return False


_zygote: Zygote | None = None
_failed: str | None = None  # why the zygote could not start: workers are started afresh
_zygote_lock = threading.Lock()
# "PID REQUESTS ANSWERS": the zygote a script forked by one was handed (_hand_over), taken
# as this module loads so that the script's own children do not see it, with the
# environment the script started in (the handed zygote's).
HANDED = "FRAMEWIRE_TEST_ZYGOTE"


def _take_handed() -> tuple[int, int, int] | None:
    """The handed zygote's pid and pipes, if this process is the script they were for."""
    words = os.environ.pop(HANDED, "").split()
    if len(words) == 4 and int(words[0]) == os.getpid():
        return int(words[1]), int(words[2]), int(words[3])
    return None


_handed = _take_handed()
_handed_env = dict(os.environ)
_torch_zygotes: dict[tuple[tuple[str, str], ...], Zygote | None] = {}  # by AT_START values


class Shared:
    """The run's zygote, started by the controller of a run on several processes before
    they start: each is handed ``path`` (``share``); ``stop`` ends it once they are done."""

    def __init__(self, preload: str = "worker") -> None:
        self._folder = tempfile.mkdtemp(prefix="framewire-zygote-")
        self.path = os.path.join(self._folder, "zygote.sock")
        self._proc = subprocess.Popen(
            [sys.executable, "-P", __file__, "--shared", self.path, preload],
            stdin=subprocess.PIPE,
        )
        deadline = time.monotonic() + 30  # bound before its imports: who connects then waits
        while not os.path.exists(self.path):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the run's zygote did not listen")
            time.sleep(0.01)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self) -> int:
        """Ends it; its exit status."""
        assert self._proc.stdin is not None
        self._proc.stdin.close()  # its sessions end with their connections
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self._folder, ignore_errors=True)
        return self._proc.returncode


_shared: str | None = None  # the socket of the run's zygote (share)


def share(path: str) -> None:
    """Fork this process's workers from the run's zygote listening at ``path``."""
    global _shared
    _shared = path


def _session() -> Zygote | None:
    """A session of the run's zygote, if there is one that can start this process's
    workers; None (and the next call tries no more) otherwise."""
    global _shared
    if _shared is None:
        return None
    try:
        forks = Zygote(shared=_shared)
    except (OSError, RuntimeError) as exc:
        warnings.warn(f"the run's zygote is not used: {exc}", stacklevel=3)
        forks = None
    if forks is not None and not forks.can_start(None):
        warnings.warn("the run's zygote started with other start variables", stacklevel=3)
        forks.close()
        forks = None
    _shared = None if forks is None else _shared
    return forks


def zygote() -> Zygote | None:
    """This test process's zygote, started on first use; None if it cannot start (each
    worker then gets its own interpreter, and the first start warns why)."""
    global _zygote, _failed, _handed
    with _zygote_lock:
        if _failed is None and (_zygote is None or not _zygote.alive()):
            try:
                if _handed is not None:
                    _zygote = Zygote(env=_handed_env, handed=_handed)
                else:
                    _zygote = _session() or Zygote()
                _handed = None
            except RuntimeError as exc:
                _failed, _zygote = str(exc), None
                warnings.warn(f"workers start without the zygote: {exc}", stacklevel=2)
        return _zygote


def torch_zygote(env: dict[str, str]) -> Zygote | None:
    """This test process's zygote for processes of ``env`` that import torch and not
    framewire first (an engine's driver in its site): it has imported torch and
    ``TORCH_SIDE``. Started on first use for each value of the variables read at start;
    None if it cannot start."""
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(AT_START)))
    with _zygote_lock:
        forks = _torch_zygotes.get(key)
        if key not in _torch_zygotes or (forks is not None and not forks.alive()):
            try:
                forks = Zygote("torch", env)
            except RuntimeError as exc:
                forks = None
                warnings.warn(f"engines start without their zygote: {exc}", stacklevel=2)
            _torch_zygotes[key] = forks
        return forks


# --- the zygote itself ------------------------------------------------------------------------


TORCH_SIDE = ("numpy", "PIL.Image", "httpx", "pydantic", "click", "rich.console")


def _preload(what: str) -> None:
    """What every process it forks imports and loads as it starts: done once, here."""
    if what == "torch":
        import importlib

        import torch  # noqa: F401

        # And the libraries that every engine's driver imports (its site's, where it pins
        # them) before the engine's code or framewire's: none of them hooks anything.
        for name in TORCH_SIDE:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
    else:
        import anyio._backends._asyncio  # noqa: F401  (what the worker's threads run on)
        import framewire.service._cli.main
        import framewire.service._worker  # noqa: F401
        from framewire.service._convert import kernels
        from framewire.service._encode.encoders import Encoders

        kernels.use("auto")
        kernels.warm()  # numba's compiled kernels, loaded from its cache: forks inherit them
        # What a worker works out once per process, as it starts or on its first /v1/info,
        # kept in per-process caches: PyAV imported, the default ffmpeg's identity (the
        # sha256 of its 170 MB, about 0.4 s of CPU), version and libx264 build, PyAV's.
        # And each encoder's colour check (core/media/colours.py), kept by identity.
        encoders = Encoders()
        encoders.describe()
        encoders.close()  # its descriptors: no fork inherits them
        try:  # the store's client library, which a worker writing object URLs imports
            import boto3  # noqa: F401
        except ImportError:
            pass
    # No Python thread may run when it forks (a fork copies only the forking thread, and
    # any lock another holds stays held). The native ones here are idle pools that
    # expect forks: OpenBLAS's (numpy) and one numba starts as it loads a kernel.
    if threading.active_count() != 1:
        raise RuntimeError("the zygote must hold one Python thread when it forks")


def _child(request: dict[str, object]) -> None:
    """In the fork: become ``framewire ARGV`` (``serve``, say), ``python SCRIPT ARGV`` or
    ``python -m MODULE ARGV`` with the request's env and directory.
    Its descriptors are those of ``python -m framewire.service`` started by Popen: 0, 1
    and 2 the request's paths, nothing else (the zygote's pipes and pidfds close)."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        paths = [str(path) for path in request["stdio"]]  # type: ignore[attr-defined]
        opened: dict[str, int] = {}  # a path named twice is one open file (a log, a terminal)
        for target, path in enumerate(paths):
            if path not in opened:
                read, write = path == paths[0], path in paths[1:]
                if read:
                    flags = os.O_RDWR if write else os.O_RDONLY
                else:
                    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                opened[path] = os.open(path, flags | os.O_NOCTTY, 0o644)
            os.dup2(opened[path], target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        # Python's streams as a fresh interpreter makes them on these descriptors: stdout
        # line-buffered on a terminal only, stderr always.
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1 if os.isatty(1) else -1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
        os.chdir(str(request["cwd"]))
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update(env)
        argv = [str(a) for a in request["argv"]]  # type: ignore[attr-defined]
        if request["module"] is not None:  # as ``python -m MODULE``: the directory first
            import runpy

            sys.argv = ["-m", *argv]  # runpy puts the module's file first
            sys.path.insert(0, os.getcwd())
            runpy.run_module(str(request["module"]), run_name="__main__", alter_sys=True)
            code = 0
        elif request["script"] is None:
            sys.argv = ["framewire", *argv]
            from framewire.service._cli.main import main

            code = main(argv)
        else:  # as ``python SCRIPT``: its folder first on the path
            import runpy

            script = str(request["script"])
            _hand_over()
            sys.argv = [script, *argv]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
            code = 0
    except SystemExit as exc:  # as the interpreter ends on one: None is 0, text is said
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        import logging

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _hand_over() -> None:
    """In a fork that is to run a script: fork a zygote for it first, this process as the
    zygote made it (one thread, the imports done), so that the workers the script starts
    (a benchmark's) are forks too rather than the children of a zygote of its own."""
    requests, to_zygote = os.pipe()
    from_zygote, answers = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(to_zygote)
        os.close(from_zygote)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        null = os.open(os.devnull, os.O_RDWR)  # the script's stdin and stdout are its own
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.close(null)
        try:
            _serve_requests(requests, answers)
        finally:
            os._exit(0)
    os.close(requests)
    os.close(answers)
    os.environ[HANDED] = f"{os.getpid()} {pid} {to_zygote} {from_zygote}"


def _serve(preload: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the test process's to handle
    _preload(preload)
    answers = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing stray reaches the control pipe
    _serve_requests(0, answers)


def _serve_shared(path: str, preload: str) -> None:
    """The run's zygote: a session (a fork of it) for each connection to ``path``, until
    stdin ends (the run's controller is done, or gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Listening before the imports (who connects early waits for the hello), and under
    # its name only once listening: a connect between bind and listen is refused.
    listener.bind(f"{path}.binding")
    listener.listen(64)
    os.rename(f"{path}.binding", path)
    _preload(preload)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    while True:
        readable, _, _ = select.select([listener, 0], [], [], 1.0)
        with contextlib.suppress(ChildProcessError):  # the sessions that ended
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        if 0 in readable and not os.read(0, 1024):
            return
        if listener in readable:
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                try:
                    _serve_requests(conn.fileno(), conn.fileno(), {"env": start_variables()})
                finally:
                    os._exit(0)
            conn.close()


def _serve_requests(requests: int, answers: int, hello: dict[str, object] | None = None) -> None:
    """Forks a child for each request line read from ``requests``; says on ``answers``
    that it is ready (with ``hello``), each child's pid, and each child's exit status."""

    def say(event: dict[str, object]) -> None:
        os.write(answers, json.dumps(event).encode() + b"\n")

    say({"started": 0} | (hello or {}))  # ready
    children: dict[int, int] = {}  # pidfd -> pid
    pending = b""
    while True:
        readable, _, _ = select.select([requests, *children], [], [])
        for fd in readable:
            if fd in children:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            data = os.read(requests, 1 << 16)
            if not data:
                return  # who asked is gone: its workers are on their own
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children[os.pidfd_open(pid)] = pid
                say({"started": pid})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--shared"]:
        _serve_shared(sys.argv[2], sys.argv[3])
    else:
        _serve(sys.argv[1] if len(sys.argv) > 1 else "worker")
