"""The python tool's local backend: model code inside bubblewrap (``backend: local``), or, with
``sandbox: unsafe_local``, under a private network namespace and rlimits alone (what the sandbox
promises: :mod:`.sandbox`)."""

from __future__ import annotations

import importlib.util
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from megatron_gspo.runtime.stops import wait_process
from megatron_gspo.toolbox.netns import unshare_network
from megatron_gspo.toolbox.python_config import PythonResult, PythonToolConfig, observation_text

__all__ = ["run_local", "sandbox_problem"]


def run_local(code: str, config: PythonToolConfig) -> PythonResult:
    """Run ``code`` on this machine: in bwrap, or, where the recipe says so, without it."""
    if config.sandbox == "unsafe_local":
        return _run(code, config, _unsafe_command, isolated=False)
    why = sandbox_problem(config)
    if why is not None:
        return PythonResult(False, f"python is unavailable here: {why}", 0.0)
    return _run(code, config, _bwrap_command, isolated=True)


# -- is the sandbox there? ---------------------------------------------------------------------

_probed: dict[tuple, str | None] = {}


def sandbox_problem(config: PythonToolConfig) -> str | None:
    """Why the local sandbox cannot run code here (None: it can), checked once per setup by
    running ``print(1)`` in it."""
    if config.backend != "local" or config.sandbox != "bwrap":
        return None
    key = (config.interpreter, tuple(config.packages))
    if key not in _probed:
        _probed[key] = _probe(config)
    return _probed[key]


def _probe(config: PythonToolConfig) -> str | None:
    if shutil.which("bwrap") is None:
        return (
            "bubblewrap (bwrap) is not installed (Debian/Ubuntu: apt-get install bubblewrap); "
            "or run model code remotely (env_kwargs.python.backend: http)"
        )
    try:
        _interpreter(config)
        _package_binds(config.packages)
    except ValueError as e:
        return str(e)
    result = _run("print(1)", config.model_copy(update={"timeout_s": 30.0}), _bwrap_command, True)
    if result.ok and result.output.strip() == "1":
        return None
    return (
        f"bwrap cannot start a sandbox here ({result.output.strip()[-300:]}): the kernel may "
        "refuse unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone, "
        "user.max_user_namespaces)"
    )


# -- the command ---------------------------------------------------------------------------------


def _interpreter(config: PythonToolConfig) -> str:
    path = config.interpreter
    if path is None:
        base = getattr(sys, "_base_executable", sys.executable)
        path = (
            "/usr/bin/python3" if os.geteuid() == 0 and Path("/usr/bin/python3").exists() else base
        )
    real = os.path.realpath(path)
    if not os.access(real, os.X_OK):
        raise ValueError(f"env_kwargs.python.interpreter {path!r} is not an executable file")
    return real


def _package_binds(packages: list[str]) -> list[tuple[str, str]]:
    """(host directory, sandbox directory) of each package (and its bundled libraries)."""
    binds = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"env_kwargs.python.packages: {name!r} is not a package here")
        src = Path(next(iter(spec.submodule_search_locations)))
        binds.append((str(src), f"/packages/{name}"))
        libs = src.parent / f"{name}.libs"  # wheels' vendored shared libraries
        if libs.is_dir():
            binds.append((str(libs), f"/packages/{name}.libs"))
    return binds


# Started inside the sandbox: the process limit (set here, inside bwrap's user namespace, where
# the kernel counts the sandbox's processes alone; set outside, it would count every thread the
# user runs), the packages on the path, then the model's code (a file in the scratch directory,
# so a traceback names its lines).
def _boot(max_processes: int | None) -> str:
    limit = (
        f"import resource; resource.setrlimit(resource.RLIMIT_NPROC, ({max_processes}, "
        f"{max_processes})); "
    )
    return (
        (limit if max_processes is not None else "")
        + "import sys; sys.path.insert(0, '/packages'); "
        + "exec(compile(open('main.py').read(), 'main.py', 'exec'))"
    )


def _bwrap_command(config: PythonToolConfig, scratch: str) -> list[str]:
    python = _interpreter(config)
    prefix = str(Path(python).parent.parent)
    cmd = ["bwrap"]
    for path in ("/usr", "/lib", "/lib64", "/bin", "/etc/alternatives"):
        if Path(path).exists():
            cmd += ["--ro-bind", path, path]
    if not prefix.startswith("/usr"):
        cmd += ["--ro-bind", prefix, prefix]
    for src, dst in _package_binds(config.packages):
        cmd += ["--ro-bind", src, dst]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    cmd += ["--bind", scratch, "/scratch", "--chdir", "/scratch"]
    cmd += ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    cmd += ["--clearenv", "--setenv", "HOME", "/scratch", "--setenv", "PATH", "/usr/bin:/bin"]
    cmd += ["--setenv", "PYTHONIOENCODING", "utf-8"]
    return [*cmd, python, "-I", "-c", _boot(config.max_processes)]


def _unsafe_command(config: PythonToolConfig, scratch: str) -> list[str]:
    return [sys.executable, "-I", "-c", _boot(None)]


# The uid code runs as where the trainer is root: one of its own per worker process, so that it
# owns nothing on the host.
_UID_BASE = 200_000


def _own_uid() -> int:
    return _UID_BASE + os.getpid() % 50_000


def _preexec(config: PythonToolConfig, isolated: bool, uid: int):
    memory = config.memory_mb * 2**20
    cpu = max(1, int(config.timeout_s) + 1)
    size = config.file_size_mb * 2**20

    def apply() -> None:
        if not isolated:
            if unshare_network() is not None:
                os._exit(97)
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        if isolated and os.geteuid() == 0:
            # No process limit here: set on this uid it would count the last call's processes
            # still being torn down; the boot sets it inside the sandbox's user namespace.
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return apply


# -- running it ---------------------------------------------------------------------------------


class _Capped:
    """Reads a pipe to its end, keeping at most ``limit`` bytes: the first ones, or the last
    (a traceback's end says what went wrong); the rest is counted and dropped, so an output
    flood costs nothing but its reading."""

    def __init__(self, pipe, limit: int, *, keep_end: bool) -> None:
        self.kept, self.total, self.limit, self.keep_end = b"", 0, limit, keep_end
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe) -> None:
        while chunk := pipe.read(65536):
            self.total += len(chunk)
            if self.keep_end:
                self.kept = (self.kept + chunk)[-self.limit :]
            elif len(self.kept) < self.limit:
                self.kept += chunk[: self.limit - len(self.kept)]

    def text(self) -> str:
        self.thread.join(timeout=5)
        text = self.kept.decode(errors="replace")
        cut = self.total - len(self.kept)
        if cut <= 0:
            return text
        return f"[{cut} bytes cut] ...{text}" if self.keep_end else f"{text}... [{cut} bytes cut]"


def _run(code: str, config: PythonToolConfig, command, isolated: bool) -> PythonResult:
    start = time.monotonic()
    uid = _own_uid()  # here: the child's pid is another
    with tempfile.TemporaryDirectory(prefix="gspo-python-") as scratch:
        Path(scratch, "main.py").write_text(code)
        if isolated and os.geteuid() == 0:
            os.chown(scratch, uid, uid)
            os.chown(Path(scratch, "main.py"), uid, uid)
        proc = subprocess.Popen(
            command(config, scratch),
            cwd=scratch,
            env={"PATH": "/usr/bin:/bin", "HOME": scratch, "PYTHONIOENCODING": "utf-8"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_preexec(config, isolated, uid),
        )
        limit = 4 * config.max_output_chars
        out = _Capped(proc.stdout, limit, keep_end=False)
        err = _Capped(proc.stderr, limit, keep_end=True)
        try:
            wait_process(proc, config.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return PythonResult(
                False, f"timed out after {config.timeout_s:g} s (killed)", time.monotonic() - start
            )
        finally:
            text, errors = out.text(), err.text()
    seconds = time.monotonic() - start
    if proc.returncode == 97 and not isolated:
        return PythonResult(False, "python is unavailable here: no network isolation", seconds)
    if proc.returncode < 0:
        errors += f"\nkilled by signal {-proc.returncode} (memory or CPU limit?)"
    return PythonResult(proc.returncode == 0, observation_text(text, errors, config), seconds)
