"""The tool sandbox (grpo_lab/interaction/sandbox.py) against hostile code of each kind: an infinite loop, a
fork bomb (also one that calls setsid to escape), a memory bomb, huge output, writing and reading outside its
directory (a directory this test owns, the repository, the home directory), a socket, killing its parent,
sleeping past the limit, a file past the size limit, exiting the interpreter.

Every case checks the same three things besides the call's status: the caller continues (run returns a
ToolResult), nothing outside the sandbox changed (this test's directory, the repository's README) and its working
directory is gone, and no process is left behind (the fork server has no child left, and no
process runs under a sandbox uid). Each isolation mode that works on this machine runs every case:
namespaces (root), userns (user namespaces) and rlimits (the fallback).
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import psutil
import pytest

from grpo_lab.interaction.sandbox import GRACE_S, UID_BASE, Limits, Sandbox, ToolResult, limits_errors

REPO = Path(__file__).resolve().parents[1]
LIMITS = Limits(wall_s=2.0, cpu_s=1, memory_mb=256, max_processes=8, file_size_mb=1, disk_mb=4, max_output_chars=100)


@pytest.fixture(scope="module", params=["namespaces", "userns", "rlimits"])
def box(request):
    try:
        sandbox = Sandbox(LIMITS, isolation=request.param, workers=2)
    except RuntimeError as err:
        pytest.skip(str(err))
    yield sandbox
    sandbox.close()


def _tree(root: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _left_behind(box: Sandbox) -> list[str]:
    """Processes of the sandbox still alive: children of its fork server, or anything under a sandbox uid
    that no other test worker started."""
    out = []
    if box._server is not None:
        for p in psutil.Process(box._server.pid).children(recursive=True):
            try:
                out.append(f"{p.pid} {p.status()} {p.cmdline()}")
            except psutil.Error:
                pass
    # Under `pytest -n 2` the other test worker's tool calls run under the same uids: a process below one of
    # this worker's sibling workers is theirs. One of ours that escaped its tree has init (or a subreaper) above.
    siblings = set()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        siblings = {c.pid for c in psutil.Process(os.getppid()).children()} - {os.getpid()}

    def strays() -> dict[tuple[int, float], str]:
        found = {}
        for p in psutil.process_iter(["pid", "uids", "create_time"]):
            uids = p.info.get("uids")
            if uids and UID_BASE <= uids.real < UID_BASE + 64:
                try:
                    if siblings & {a.pid for a in p.parents()}:
                        continue
                except psutil.Error:
                    continue   # gone while looked at
                found[(p.pid, p.info["create_time"])] = f"{p.pid} uid {uids.real}"
        return found

    # A sibling worker's sandbox ending its tree orphans a grandchild for an instant before it kills it: a
    # stray counts only if the same process is still there a moment later (one of ours that escaped would be).
    first = strays()
    if first:
        time.sleep(3.0)
        later = strays()
        out += [text for key, text in first.items() if key in later]
    return out


def hostile(box: Sandbox, code: str, watched: Path) -> ToolResult:
    """Run `code`; assert that the caller continues, nothing outside changed and no process is left."""
    readme = (REPO / "README.md").stat()
    tree = _tree(watched)
    # The working directories this call makes are recorded as they are made: the temporary directory is shared
    # with other test workers whose tool runs make `grpo_tool_*` directories of their own at the same time.
    made, mkdtemp = [], tempfile.mkdtemp

    def recorded_mkdtemp(*args, **kwargs):
        made.append(mkdtemp(*args, **kwargs))
        return made[-1]

    started = time.monotonic()
    with mock.patch.object(tempfile, "mkdtemp", recorded_mkdtemp):
        result = box.run(code)
    assert isinstance(result, ToolResult) and result.status in ("ok", "error", "timeout", "killed")
    assert time.monotonic() - started < box.limits.wall_s + GRACE_S + 3.0
    assert _tree(watched) == tree, "the sandbox changed a directory it does not own"
    assert (REPO / "README.md").stat().st_mtime_ns == readme.st_mtime_ns
    assert made, "the sandbox made no working directory of its own"
    assert not [d for d in made if os.path.exists(d)], "a working directory was left behind"
    assert not _left_behind(box)
    return result


def test_an_infinite_loop_is_stopped_by_the_cpu_limit(box, tmp_path):
    r = hostile(box, "while True:\n    pass", tmp_path)
    assert r.status in ("killed", "timeout") and r.time_s < LIMITS.wall_s + GRACE_S + 1


def test_sleeping_past_the_limit_is_a_timeout(box, tmp_path):
    r = hostile(box, "import time\ntime.sleep(60)", tmp_path)
    assert r.status == "timeout" and "timeout" in r.output
    assert LIMITS.wall_s - 0.1 <= r.time_s < LIMITS.wall_s + GRACE_S + 1


def test_a_fork_bomb_is_contained(box, tmp_path):
    r = hostile(box, "import os\nwhile True:\n    os.fork()", tmp_path)
    if box.mode == "namespaces":   # RLIMIT_NPROC under the call's own uid: fork fails at once
        assert r.status == "error" and "Resource temporarily unavailable" in r.output
    elif box.mode == "rlimits":    # the audit hook refuses fork
        assert r.status == "error" and "os.fork is not allowed" in r.output
    else:                          # a user namespace started by root: not counted, stopped at the wall clock
        assert r.status in ("error", "timeout", "killed")


def test_a_process_that_leaves_the_session_dies_with_the_call(box, tmp_path):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    r = hostile(box, code, tmp_path)   # hostile() asserts that the sleeper is gone
    assert r.status == ("error" if box.mode == "rlimits" else "ok")


def test_a_memory_bomb_raises_memory_error(box, tmp_path):
    r = hostile(box, "x = bytearray(4 * 1024**3)", tmp_path)
    assert r.status == "error" and r.output == "MemoryError"
    r = hostile(box, "chunks = []\nwhile True:\n    chunks.append(' ' * 10**7)", tmp_path)
    assert r.status in ("error", "killed")


def test_huge_output_is_cut_to_max_output_chars(box, tmp_path):
    r = hostile(box, "print('x' * 10**7)", tmp_path)
    assert r.status == "ok" and r.output == "x" * LIMITS.max_output_chars and r.truncated
    # Writing to fd 1 directly reaches /dev/null, not the caller.
    r = hostile(box, "import os\nfor _ in range(200):\n    os.write(1, b'y' * 65536)\nprint('done')", tmp_path)
    assert r.status in ("ok", "error") and "y" not in r.output


def test_writing_outside_its_directory_fails(box, tmp_path):
    target = tmp_path / "owned_by_the_test"
    target.mkdir()
    (target / "keep.txt").write_text("unchanged")
    for path in [target / "pwned.txt", target / "keep.txt", REPO / "README.md", Path("/tmp/grpo_tool_pwned.txt")]:
        r = hostile(box, f"open({str(path)!r}, 'a').write('pwned')", tmp_path)
        assert r.status == "error", (path, r)
    assert not (target / "pwned.txt").exists() and (target / "keep.txt").read_text() == "unchanged"
    assert not Path("/tmp/grpo_tool_pwned.txt").exists()


def test_reading_outside_its_directory_fails(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the-secret-token")
    for code in [f"print(open({str(secret)!r}).read())", f"print(open({str(REPO / 'README.md')!r}).read()[:50])",
                 f"import os\nprint(os.listdir({str(Path.home() / '.ssh')!r}))"]:
        r = hostile(box, code, tmp_path)
        assert r.status == "error", (code, r)
        assert "the-secret-token" not in r.output
    # The repository and this test's directory: refused, or (namespaces) an empty directory in their place.
    for path in (REPO, tmp_path):
        r = hostile(box, f"import os\nprint(os.listdir({str(path)!r}))", tmp_path)
        assert r.status == "error" or r.output == "[]\n", (path, r)


def test_no_network(box, tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        for address in [("127.0.0.1", port), ("1.1.1.1", 80)]:
            code = f"import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect({address!r})\nprint('connected')"
            r = hostile(box, code, tmp_path)
            assert r.status == "error" and "connected" not in r.output
        with pytest.raises(BlockingIOError):
            server.accept()          # nothing reached the test's server
    finally:
        server.close()


def test_killing_its_parent_or_everything_leaves_the_caller_running(box, tmp_path):
    for code in ["import os\nos.kill(os.getppid(), 9)", "import os\nos.kill(-1, 9)", "import os\nos.killpg(0, 9)"]:
        r = hostile(box, code, tmp_path)
        assert r.status in ("ok", "error", "killed")
    assert box.run("print(6 * 7)").output == "42\n"   # the sandbox still serves calls


def test_file_size_and_disk_limits(box, tmp_path):
    r = hostile(box, "open('big', 'wb').write(b'x' * (5 * 2**20))", tmp_path)
    assert r.status == "error" and "File too large" in r.output
    if box.mode in ("namespaces", "userns"):   # the working directory is a tmpfs of disk_mb
        code = "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * 2**19)"
        r = hostile(box, code, tmp_path)
        assert r.status == "error" and "No space left on device" in r.output


def test_exiting_the_interpreter(box, tmp_path):
    assert hostile(box, "import os\nos._exit(3)", tmp_path).status == "killed"
    r = hostile(box, "raise SystemExit(2)", tmp_path)
    assert r.status == "error" and r.output == "SystemExit: 2"


def test_an_empty_working_directory_and_a_minimal_environment(box, tmp_path, monkeypatch):
    r = hostile(box, "import os\nprint(os.listdir('.'))\nopen('a.txt', 'w').write('1')\nprint(open('a.txt').read())",
                tmp_path)
    assert r.status == "ok" and r.output == "[]\n1\n"
    r = hostile(box, "import os\nprint(sorted(os.environ))", tmp_path)
    assert r.output == "['HOME', 'LANG', 'PATH', 'TMPDIR']\n"
    if box.mode != "rlimits":
        r = hostile(box, "import os\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]))", tmp_path)
        assert r.status == "ok" and int(r.output) <= 3   # the supervisor and the worker: no trainer in sight


def test_a_variable_of_the_trainer_never_reaches_the_code(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_LAB_TEST_SECRET", "s3cr3t")
    sandbox = Sandbox(LIMITS, isolation="auto")
    try:
        r = sandbox.run("import os\nprint(os.environ.get('GRPO_LAB_TEST_SECRET'))")
        assert r.output == "None\n"
    finally:
        sandbox.close()


def test_outputs_errors_and_the_last_expression(box):
    assert box.run("123*456").output == "56088\n"
    assert box.run("x = 5\nx * 2").output == "10\n"
    assert box.run("print('a')\nNone").output == "a\n"
    r = box.run("1/0")
    assert (r.status, r.output) == ("error", "ZeroDivisionError: division by zero")
    r = box.run("def f(:\n  pass")
    assert r.status == "error" and r.output.startswith("SyntaxError")


def test_concurrent_calls_each_get_their_own_process(box):
    results = {}

    def one(k):
        results[k] = box.run(f"import os\nprint({k} * 11)")

    threads = [threading.Thread(target=one, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {k: r.output for k, r in results.items()} == {k: f"{k * 11}\n" for k in range(6)}
    assert not _left_behind(box)


def test_limits_are_validated_by_name():
    errors = limits_errors(Limits(wall_s=0, cpu_s=0, memory_mb=16, max_processes=0, file_size_mb=0, disk_mb=0,
                                  max_output_chars=0))
    for key in ("wall_s", "cpu_s", "memory_mb", "max_processes", "file_size_mb", "disk_mb", "max_output_chars"):
        assert any(f"interaction.tool.{key}=" in e for e in errors), key
    assert limits_errors(LIMITS) == []
