"""Untrusted code in a sandbox: one fresh process tree per call, limited, cut off and cleaned up.

`Sandbox.run(code)` asks the sandbox's fork server (grpo_lab/interaction/sandbox_runner.py, started once as
``python -I -S -B``: the trainer's interpreter without site-packages, the lab or any PYTHON* variable, in an
empty environment) for a call process, hands it the code and a result pipe, and reads one report from that
pipe, at most `max_report_bytes` of it. The call's supervisor stops the code at `wall_s`; the caller stops
waiting at `wall_s` + 1 s and kills the call's process group (SIGKILL) in every case, then removes the
working directory. `run` never raises for anything the code does: every outcome is a `ToolResult` with a
status:

    ok        the code ran to its end                       (its stdout, or its last expression's value)
    error     the code raised (MemoryError at the memory limit, PermissionError, OSError past the file
              size limit, a failed fork past the process limit, ...)        -> tool/errors
    timeout   still running after wall_s: killed                             -> tool/timeouts
    killed    ended without a report: a signal (SIGXCPU/SIGKILL at the CPU limit, a crash) or the
              code took its own process down                                 -> tool/killed

What is enforced, by whom (`isolation`; `auto` takes the first mode whose trial call works here, once):

==================  ===================================================  ==================================
                    namespaces (root) / userns (any user, where the       rlimits (the fallback)
                    kernel allows unprivileged user namespaces)
==================  ===================================================  ==================================
CPU                 RLIMIT_CPU = cpu_s (SIGXCPU, SIGKILL one s later)     the same
memory              RLIMIT_AS = memory_mb                                 the same
wall clock          the supervisor kills the worker at wall_s; it is      the same, and an audit hook
                    PID 1 of a PID namespace, so every process the code   refuses fork/exec/spawn (no
                    started dies with it (setsid() does not escape)       process can outlive the group)
processes           RLIMIT_NPROC = max_processes, counted for the         RLIMIT_NPROC = max_processes + the
                    worker's own user: root starts it under an unused     user's current count (a user-wide
                    uid (UID_BASE + slot); in a user namespace the        count; never enforced for root)
                    kernel counts the caller's uid (not for root)
file size / disk    RLIMIT_FSIZE = file_size_mb; the working directory    RLIMIT_FSIZE only (the working
                    is a tmpfs of disk_mb                                 directory is on disk)
files               every mount read-only; homes, temporary dirs, /run,   the audit hook refuses open() and
                    the repository and the trainer's directory hidden     file operations outside the
                    under empty tmpfs; the working directory is the       working directory (reads also in
                    only writable place; root also drops to that uid      the interpreter's prefix)
network             an empty network namespace (no interface up); unix    the audit hook refuses socket.*
                    sockets under /run and /tmp are hidden
the trainer         not visible (PID namespace), not signalable (other    the audit hook refuses os.kill;
                    uid / no capabilities), /proc shows the sandbox only  the same uid as the trainer
==================  ===================================================  ==================================

Every mode: a minimal environment (PATH, LANG, HOME = TMPDIR = the working directory: no inherited variable,
no tokens, no proxies), no-new-privileges, no core files, 64 open files, stdin/stdout/stderr at /dev/null
(the code's print() is captured up to max_output_chars), every descriptor of the trainer closed. The audit
hook is Python-level: code that reaches C without raising an audited event (ctypes is refused, but that is
not proof) is not stopped by it, so `rlimits` is a fallback, not a boundary; `auto` says so when it falls back.
"""

from __future__ import annotations

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).with_name("sandbox_runner.py")
ISOLATIONS = ("auto", "namespaces", "userns", "rlimits")
STATUSES = ("ok", "error", "timeout", "killed")
# Unprivileged uids a root-started sandbox runs its code under, one per concurrent call (slot): unused by any
# account, so RLIMIT_NPROC counts exactly that call's processes.
UID_BASE = 2_000_000_000
# Longest code sent to the fork server (its request limit is 128 KiB); longer code is an error result.
MAX_CODE_CHARS = 32_768
# Seconds the caller waits past wall_s for the supervisor's own timeout report before killing the group.
GRACE_S = 1.0


@dataclass(frozen=True)
class Limits:
    """One call's limits (interaction.tool.*, whose schema holds their defaults; checked by `limits_errors`)."""
    wall_s: float
    cpu_s: int
    memory_mb: int
    max_processes: int
    file_size_mb: int
    disk_mb: int
    max_output_chars: int

    @classmethod
    def of(cls, settings: Any = None) -> Limits:
        """The limits an interaction.tool section (or any object with these attributes) sets; None: the
        schema's defaults (grpo_lab.schema.ToolConfig)."""
        if settings is None:
            from grpo_lab.schema import ToolConfig

            settings = ToolConfig()
        return cls(wall_s=float(settings.wall_s), cpu_s=int(settings.cpu_s), memory_mb=int(settings.memory_mb),
                   max_processes=int(settings.max_processes), file_size_mb=int(settings.file_size_mb),
                   disk_mb=int(settings.disk_mb), max_output_chars=int(settings.max_output_chars))


def limits_errors(limits: Limits, where: str = "interaction.tool") -> list[str]:
    """What is wrong with `limits`, naming each key."""
    out = []
    if not limits.wall_s > 0:
        out.append(f"{where}.wall_s={limits.wall_s} must be > 0 (seconds before a call is killed)")
    for key, low in (("cpu_s", 1), ("memory_mb", 64), ("max_processes", 1), ("file_size_mb", 1), ("disk_mb", 1),
                     ("max_output_chars", 1)):
        value = getattr(limits, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            out.append(f"{where}.{key}={value!r} must be an integer >= {low}"
                       + (" (the interpreter itself needs about 30 MB of address space)" if key == "memory_mb" else ""))
    return out


@dataclass
class ToolResult:
    """One call's outcome (module docstring). `output` is what the actor is shown: stdout (the last
    expression's value included), or the error's last line, or a note for timeout/killed; at most
    max_output_chars characters, with `truncated` set when more came."""
    status: str
    output: str
    stdout: str = ""
    error: str | None = None
    time_s: float = 0.0
    truncated: bool = False
    details: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def default_hide_paths() -> list[str]:
    """Paths no tool call may see (namespace modes): homes, temporary dirs, /run (unix sockets), the
    repository holding this package, the trainer's directory and its virtual environment."""
    repo = Path(__file__).resolve().parents[2]
    paths = [os.path.expanduser("~"), "/root", "/home", "/tmp", "/var/tmp", "/dev/shm", "/run", "/var/run",
             tempfile.gettempdir(), str(repo), os.getcwd(), sys.prefix]
    return sorted({os.path.realpath(p) for p in paths if p and os.path.realpath(p) != "/"}, key=len)


def _remove(path: str) -> None:
    """Remove the working directory whatever the code left in it (read-only dirs included)."""
    def _retry(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=_retry)


def _gone(pid: int, timeout: float) -> bool:
    """Wait until process `pid` no longer exists (the fork server reaps its call processes at once)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        time.sleep(0.001)
    return False


class Sandbox:
    """Runs code by `run`; thread-safe (each call its own process tree and slot). `mode` is the isolation
    in force (auto resolved). `close` stops the fork server."""

    def __init__(self, limits: Limits | None = None, *, isolation: str = "auto", hide_paths: list[str] = (),
                 workers: int = 1):
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation={isolation!r}; valid: {', '.join(ISOLATIONS)}")
        self.limits = limits or Limits.of()
        self.hide_paths = sorted({*default_hide_paths(), *(os.path.realpath(p) for p in hide_paths)}, key=len)
        self._exe = os.path.realpath(sys.executable)            # the base interpreter, not a venv's wrapper
        self._keep = [os.path.realpath(sys.base_prefix)]        # its standard library stays readable
        self._slots = list(range(max(1, int(workers))))
        self._free = threading.Semaphore(len(self._slots))
        self._lock = threading.Lock()                          # slots and the server's socket
        self._server: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self.mode = "rlimits"
        self.mode = self._resolve(isolation)

    # ------------------------------------------------------------------ the fork server
    def _start_server(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._server = subprocess.Popen(
                [self._exe, "-I", "-S", "-B", str(RUNNER), "--serve", str(theirs.fileno())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd="/",
                start_new_session=True)
        finally:
            theirs.close()
        ours.settimeout(30.0)
        self._sock = ours

    def _spawn(self, request: dict, result_fd: int) -> int:
        """A call process for `request` (its pid); the server is restarted once if it is gone."""
        data = json.dumps(request).encode()
        for attempt in (0, 1):
            with self._lock:
                try:
                    if self._server is None or self._server.poll() is not None:
                        self._stop_server()
                        self._start_server()
                    socket.send_fds(self._sock, [data], [result_fd])
                    pid = int(self._sock.recv(64) or b"-1")
                    if pid > 0:
                        return pid
                except (OSError, ValueError):
                    pass
                self._stop_server()
        raise RuntimeError("the sandbox's fork server does not answer (grpo_lab/interaction/sandbox_runner.py)")

    def _stop_server(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._server is not None:
            self._server.kill()
            self._server.wait()
            self._server = None

    def close(self) -> None:
        """Stop the fork server (a later call starts it again)."""
        with self._lock:
            self._stop_server()

    def __del__(self):
        try:
            self._stop_server()
        except Exception:   # noqa: BLE001  interpreter shutdown
            pass

    def _resolve(self, isolation: str) -> str:
        """The isolation to use: `isolation` itself, or for auto the first of namespaces (root), userns,
        rlimits whose trial call runs here. A named mode whose trial fails raises RuntimeError."""
        order = {"auto": (["namespaces"] if os.geteuid() == 0 else []) + ["userns"]}.get(isolation, [isolation])
        for mode in order:
            if mode == "rlimits":
                return mode
            self.mode = mode
            trial = self.run("print(1)")
            if trial.status == "ok" and trial.output == "1\n":
                return mode
            why = trial.details.get("setup_error") or trial.error or trial.output
        if isolation == "auto":
            return "rlimits"
        raise RuntimeError(f"interaction.tool.isolation={isolation} does not work on this machine ({why}); use "
                           "isolation=auto (it falls back to rlimits) or rlimits")

    # ------------------------------------------------------------------ one call
    def _request(self, code: str, workdir: str, slot: int) -> dict:
        lim = self.limits
        return {"code": code, "workdir": workdir, "mode": self.mode,
                "uid": UID_BASE + slot if self.mode == "namespaces" else None,   # only root can hand out a uid
                "nproc": "own" if self.mode in ("namespaces", "userns") else "shared",
                "audit": self.mode == "rlimits",
                "keep_paths": self._keep, "hide_paths": self.hide_paths,
                "wall_s": lim.wall_s, "max_output_chars": lim.max_output_chars,
                "max_report_bytes": 8 * lim.max_output_chars + 8192,
                "limits": {"cpu_s": lim.cpu_s, "memory_mb": lim.memory_mb, "max_processes": lim.max_processes,
                           "file_size_mb": lim.file_size_mb, "disk_mb": lim.disk_mb}}

    def run(self, code: str) -> ToolResult:
        """Run `code` once (module docstring); never raises for what the code does."""
        if len(code) > MAX_CODE_CHARS:
            message = f"error: the code is longer than {MAX_CODE_CHARS} characters"
            return ToolResult("error", message[: self.limits.max_output_chars], error=message)
        with self._free:
            with self._lock:
                slot = self._slots.pop()
            try:
                return self._run(code, slot)
            finally:
                with self._lock:
                    self._slots.append(slot)

    def _run(self, code: str, slot: int) -> ToolResult:
        lim = self.limits
        started = time.monotonic()
        workdir = tempfile.mkdtemp(prefix="grpo_tool_")
        read_end, write_end = os.pipe()
        pid = None
        try:
            try:
                pid = self._spawn(self._request(code, workdir, slot), write_end)
            finally:
                os.close(write_end)
            data, waited_out = self._read(read_end, cap=8 * lim.max_output_chars + 16384,
                                          deadline=started + lim.wall_s + GRACE_S)
        finally:
            os.close(read_end)
            if pid is not None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                _gone(pid, timeout=2.0)
            _remove(workdir)
        return self._result(data, waited_out, time.monotonic() - started)

    @staticmethod
    def _read(fd: int, *, cap: int, deadline: float) -> tuple[bytes, bool]:
        """Read `fd` to its end or to `deadline` (then True), keeping at most `cap` bytes."""
        data = bytearray()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(data), True
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return bytes(data), False
            if len(data) < cap:
                data += chunk[: cap - len(data)]

    def _result(self, data: bytes, waited_out: bool, seconds: float) -> ToolResult:
        cap = self.limits.max_output_chars
        try:
            report = json.loads(data.decode("utf-8", "replace"))
        except ValueError:
            report = None
        report = report if isinstance(report, dict) else {}
        details = {k: report[k] for k in ("held", "exit_code", "setup_error") if k in report}
        if waited_out or report.get("timed_out"):
            return ToolResult("timeout", f"timeout: the code ran past {self.limits.wall_s:g} s and was stopped",
                              time_s=seconds, details=details)
        work = report.get("worker")
        if not isinstance(work, dict):
            code = details.get("exit_code")
            why = (f"signal {signal.Signals(-code).name}" if isinstance(code, int) and code < 0 and
                   -code in signal.Signals._value2member_map_ else f"exit code {code}" if code is not None
                   else details.get("setup_error") or "no report")
            return ToolResult("killed", f"killed: the process ended without a result ({why})", time_s=seconds,
                              details=details)
        stdout = str(work.get("stdout") or "")
        error = work.get("error")
        if error is not None:
            error = str(error)
            return ToolResult("error", error[:cap], stdout=stdout[:cap], error=error, time_s=seconds,
                              truncated=len(error) > cap, details=details)
        more = int(work.get("stdout_chars") or 0) > cap
        return ToolResult("ok", stdout[:cap], stdout=stdout[:cap], time_s=seconds, truncated=more or len(stdout) > cap,
                          details=details)


__all__ = ["ISOLATIONS", "Limits", "STATUSES", "Sandbox", "ToolResult", "UID_BASE", "limits_errors"]


def _main(argv: list[str]) -> None:   # python -m grpo_lab.interaction.sandbox 'print(1)' ...  (a quick look)
    box = Sandbox()
    for code in argv or ["print(6*7)"]:
        r = box.run(code)
        print(json.dumps({"mode": box.mode, "status": r.status, "output": r.output, "time_s": round(r.time_s, 3),
                          **r.details}, default=str))
    box.close()


if __name__ == "__main__":
    _main(sys.argv[1:])
