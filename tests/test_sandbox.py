"""The python tool's sandbox, attacked as a policy under RL would attack it, through the tool as
the model calls it: every attack fails as an error observation (or an output that shows it
reached nothing), honest code works, through the local sandbox (bubblewrap) and through a
remote SandboxFusion-compatible service (tests/support/sandbox_server.py, which runs the code
in the same local sandbox: the remote path must carry the same failures back).

CI installs bubblewrap (.ci/run); where it is missing the local cases skip, saying so.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_gspo.toolbox.bwrap import sandbox_problem
from megatron_gspo.toolbox.python_config import PythonToolConfig
from megatron_gspo.toolbox.tools import ToolError, make_python_tool
from tests.support.pausing import paused
from tests.support.runs import ROOT
from tests.support.sandbox_server import SandboxServer

LOCAL = PythonToolConfig(timeout_s=5, memory_mb=256)
WHY = sandbox_problem(LOCAL)
needs_bwrap = pytest.mark.skipif(WHY is not None, reason=f"no sandbox here: {WHY}")
pytestmark = needs_bwrap


@pytest.fixture(scope="module")
def server():
    s = SandboxServer()
    yield s
    s.close()


@pytest.fixture(params=["local", "http"])
def python(request, server):
    """The tool, as the environment builds it from env_kwargs.python."""
    if request.param == "local":
        return make_python_tool(LOCAL.model_dump())
    return make_python_tool(
        {"backend": "http", "url": server.url, "timeout_s": 5, "memory_mb": 256}
    )


def attack(python, code: str) -> str:
    """The observation the model reads: the output, or the error's message."""
    with pytest.raises(ToolError) as e:
        python(code=code)
    return str(e.value)


def test_honest_code_works(python):
    assert python(code="import math\nprint(math.factorial(5), 2 ** 10)") == "120 1024"
    assert (
        python(code="open('notes.txt', 'w').write('ok')\nprint(open('notes.txt').read())") == "ok"
    )


def test_files_outside_the_scratch_directory_cannot_be_read(python, tmp_path):
    answers = tmp_path / "answers.jsonl"
    answers.write_text('{"answer": "SECRET-42"}\n')
    for path in (answers, ROOT / "README.md", ROOT / "recipes" / "tiny-moe.yaml", tmp_path):
        seen = attack(python, f"print(open({str(path)!r}).read())")
        assert "SECRET-42" not in seen and ("No such file" in seen or "Is a directory" in seen), (
            seen
        )
    # Not the home directory, not the other users' files either.
    seen = attack(
        python, "import os; print(os.listdir(os.path.expanduser('~')) + os.listdir('/root'))"
    )
    assert "No such file" in seen or "Permission" in seen, seen


def test_nothing_outside_the_scratch_directory_can_be_written(python, tmp_path):
    victim = tmp_path / "checkpoint.pt"
    victim.write_text("weights")
    for target in (victim, ROOT / "README.md", Path("/usr/lib/evil")):
        attack(python, f"open({str(target)!r}, 'w').write('pwned')")
    assert victim.read_text() == "weights"
    assert "pwned" not in (ROOT / "README.md").read_text()[:100]
    assert not Path("/usr/lib/evil").exists()


# A uid that owns the package the sandbox shows: a trainer that is not root and owns its own
# virtualenv. Only a read-only bind keeps model code from rewriting what it imports.
OWNER_UID = 54_321


def _as_owner(package_dir: Path, conn) -> None:
    """In a forked child: become the package's owner (not root) and run code in the sandbox
    that tries to rewrite the package it was shown; send back what it printed."""
    try:
        os.setgroups([])
        os.setgid(OWNER_UID)
        os.setuid(OWNER_UID)
        sys.path.insert(0, str(package_dir.parent))
        tool = make_python_tool(
            {
                **LOCAL.model_dump(),
                "packages": [package_dir.name],
                "interpreter": "/usr/bin/python3",
            }
        )
        code = (
            "import gspo_owned_pkg, os\n"
            "print('imported', gspo_owned_pkg.VALUE)\n"
            "for path in ('/packages/gspo_owned_pkg/__init__.py', "
            "'/packages/gspo_owned_pkg/evil.py'):\n"
            "    try:\n"
            "        open(path, 'a').write('VALUE = 666\\n')\n"
            "        print('WROTE', path)\n"
            "    except OSError as e:\n"
            "        print('refused', type(e).__name__, e.strerror)\n"
        )
        conn.send(("ok", tool(code=code)))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()
        os._exit(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_packages_shown_to_the_code_stay_read_only_to_a_user_who_owns_them():
    import multiprocessing as mp
    import tempfile

    # Not under pytest's tmp_path, whose parents only root may enter.
    owned = Path(tempfile.mkdtemp(prefix="gspo-owned-"))
    package = owned / "gspo_owned_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("VALUE = 1\n")
    for path in (owned, package, package / "__init__.py"):
        os.chown(path, OWNER_UID, OWNER_UID)
    try:
        parent, child = mp.get_context("fork").Pipe()
        proc = mp.get_context("fork").Process(target=_as_owner, args=(package, child))
        proc.start()
        assert parent.poll(60), "the sandboxed call as the owner did not answer"
        status, seen = parent.recv()
        proc.join(10)
        assert status == "ok", seen
        assert "imported 1" in seen, seen
        assert "WROTE" not in seen, f"code rewrote a package it was shown: {seen}"
        assert seen.count("refused OSError Read-only file system") == 2, seen
        assert (package / "__init__.py").read_text() == "VALUE = 1\n"
        assert not (package / "evil.py").exists()
    finally:
        shutil.rmtree(owned)


def test_no_other_process_is_visible_or_reachable(python):
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = f"import os\nos.kill({sibling.pid}, 9)"
        seen = attack(python, code)
        assert "ProcessLookupError" in seen, seen
        listed = python(
            code="import os\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]))"
        )
        assert int(listed) <= 3, f"the sandbox sees {listed} processes"
        seen = attack(python, f"import os\nos.kill({os.getpid()}, 9)")  # the trainer itself
        assert "ProcessLookupError" in seen, seen
        assert sibling.poll() is None, "the sandboxed code killed a process of the host"
    finally:
        sibling.kill()


def test_a_server_on_the_hosts_loopback_cannot_be_reached(python):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    accepted: list = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    seen = attack(
        python, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
    )
    assert "Connection refused" in seen or "unreachable" in seen, seen
    seen = attack(
        python, "import urllib.request\nurllib.request.urlopen('http://1.1.1.1', timeout=2)"
    )
    assert "unreachable" in seen or "Network" in seen or "refused" in seen, seen
    listener.close()
    assert not accepted, "the sandboxed code reached a server on the host"


@pytest.mark.parametrize(
    "code, expect",
    [
        ("import os\nwhile True:\n    os.fork()", "Resource temporarily unavailable"),
        ("x = bytearray(2 ** 33)", "MemoryError"),
        (
            "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)",
            "timed out after 5 s",
        ),
        ("while True: pass", "timed out after 5 s"),
    ],
    ids=["fork-bomb", "memory-bomb", "ignores-sigterm", "spins"],
)
def test_bombs_and_stubborn_processes_end_as_an_error_within_the_deadline(python, code, expect):
    start = time.monotonic()
    seen = attack(python, code)
    assert expect in seen, seen
    assert time.monotonic() - start < 5 + 12, "the call outlived its deadline"
    # The machine is fine afterwards.
    assert python(code="print('alive')") == "alive"


# A trainer running the tool once: 3 s of work under a 5 s deadline.
_STOPPED_TRAINER = """
from megatron_gspo.toolbox.tools import make_python_tool
python = make_python_tool({"timeout_s": 5, "memory_mb": 256})
print("calling", flush=True)
print(python(code="import time; time.sleep(3); print('done')").strip(), flush=True)
"""


@pytest.mark.timeout(120)
def test_code_stopped_with_the_trainer_is_not_timed_out_for_the_stop():
    """The trainer and the sandboxed code stopped together (a suspended Slurm job) for 8 s, a
    second into 3 s of work under a 5 s deadline: the code finishes on resume."""
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_TRAINER], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "calling"
        time.sleep(1.0)
        with paused(proc.pid):
            time.sleep(8.0)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert out.strip() == "done", (out, err[-2000:])


def test_an_output_flood_is_cut_and_costs_nothing(python):
    start = time.monotonic()
    out = python(code="import sys\nfor _ in range(20000):\n    sys.stdout.write('x' * 1000)")
    assert len(out) < 1200 and "cut" in out, len(out)
    seen = attack(python, "while True: print('y' * 1000)")
    assert "timed out" in seen and len(seen) < 2000
    assert time.monotonic() - start < 30


def test_the_remote_backend_fails_a_call_on_a_broken_service(server):
    python = make_python_tool({"backend": "http", "url": server.url, "timeout_s": 1})
    for mode, expect in (("garbage", "did not answer"), ("error", "sandbox error")):
        server.mode = mode
        try:
            assert expect in attack(python, "print(1)")
        finally:
            server.mode = "ok"
    down = make_python_tool({"backend": "http", "url": "http://127.0.0.1:9", "timeout_s": 1})
    assert "did not answer" in attack(down, "print(1)")


@pytest.mark.slow
def test_a_hanging_remote_service_costs_the_call_its_deadline(server):
    from megatron_gspo.toolbox.remote import ROUND_TRIP_S

    python = make_python_tool({"backend": "http", "url": server.url, "timeout_s": 1})
    server.mode = "hang"
    start = time.monotonic()
    try:
        assert "did not answer" in attack(python, "print(1)")
    finally:
        server.mode = "ok"
    assert time.monotonic() - start < 1 + ROUND_TRIP_S + 5


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")
def test_without_a_sandbox_the_tool_refuses_unless_told_otherwise(monkeypatch, caplog):
    import megatron_gspo.toolbox.bwrap as sandbox

    monkeypatch.setattr(sandbox, "_probed", {})
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    python = make_python_tool({"timeout_s": 2})
    seen = attack(python, "print(1)")
    assert "bubblewrap (bwrap) is not installed" in seen and "apt-get install bubblewrap" in seen
    unsafe = make_python_tool({"sandbox": "unsafe_local", "timeout_s": 2})
    assert "WITHOUT a sandbox" in caplog.text
    assert unsafe(code="print(1)") == "1"


def _tools_recipe(tmp_path: Path, python: dict) -> Path:
    from tests.support.runs import loop_recipe, write_recipe

    data = loop_recipe(
        tmp_path / "run",
        rollout={
            "multi_turn": {
                "env": "tools",
                "env_kwargs": {"tools": ["calculator", "python"], "python": python},
            }
        },
    )
    return write_recipe(tmp_path, data)


def test_validate_says_where_the_python_tool_runs_and_refuses_bad_settings(tmp_path, server):
    from tests.support.runs import cli, one_line_error

    proc = cli("validate", str(_tools_recipe(tmp_path, {"timeout_s": 3})))
    assert proc.returncode == 0, proc.stderr
    assert "runs model code in a bubblewrap sandbox (works here)" in proc.stdout, proc.stdout
    proc = cli("validate", str(_tools_recipe(tmp_path, {"backend": "http", "url": server.url})))
    assert proc.returncode == 0 and f"runs on the service at {server.url}" in proc.stdout
    proc = cli("validate", str(_tools_recipe(tmp_path, {"timeout": 3})))
    one_line_error(proc, "rollout.multi_turn.env_kwargs.python: timeout: Extra inputs")
    proc = cli("validate", str(_tools_recipe(tmp_path, {"backend": "http"})))
    one_line_error(proc, "backend http needs url")
