"""The inside of the sandbox (grpo_lab/interaction/sandbox.py starts it; read that module first).

A fork server: started once per Sandbox as ``python -I -S -B sandbox_runner.py --serve FD`` (no site-packages,
no user site, no PYTHON* variable, no bytecode written, an empty environment), it imports the standard library
only (the lab, torch and every installed package stay out of reach), runs no untrusted code itself, and for
every request read from the socket FD (JSON, with the call's result pipe attached) forks one *call process*
and answers with its pid. Forking a clean server costs a few milliseconds where a fresh interpreter costs tens.

The call process (its own session: the caller kills its process group at the end) closes every inherited
descriptor but the result pipe, then, with namespaces, enters new mount, network and PID namespaces (and a
user namespace in userns mode, mapping the caller's uid to 0) and forks the *supervisor*, PID 1 of the new PID
namespace, which dies with it (PR_SET_PDEATHSIG). The supervisor:

1. with namespaces: mounts a fresh /proc (it shows the sandbox's processes only), makes every mount
   read-only (``mount_setattr``, recursive), mounts a size-capped tmpfs on the (empty) working directory,
   hides the given paths (homes, temporary dirs, /run, the repository, the trainer's directory) under empty
   read-only tmpfs mounts, re-binding only the interpreter's own prefix (read-only) and the working
   directory (read-write) beneath them;
2. forks the worker that runs the code, waits for it at most ``wall_s`` (then kills it: a timeout), reads its
   report (capped) and writes one JSON report to the result pipe.

The worker sets the resource limits (CPU seconds, address space, processes, file size, open files, no core
files), drops privileges (to the request's unprivileged uid when the sandbox was started by root; in a user
namespace, every capability and the means to regain them), sets no-new-privileges, points fds 0-2 at
/dev/null, installs an audit hook when the request asks for one (the fallback without namespaces), and runs
the code with stdout captured up to ``max_output_chars``. A last line that is an expression is printed as
the interactive interpreter prints it (``42*25`` -> ``1050``). Processes the code forks end silently: only
the worker reports.

When the supervisor exits, the kernel kills every process left in its PID namespace (those that called
setsid() too). Nothing here trusts the worker: its report is read as at most ``max_report_bytes`` and parsed
defensively.
"""

from __future__ import annotations

import ast
import ctypes
import errno
import json
import os
import resource
import select
import signal
import socket
import sys
import time

# <linux/mount.h>, <linux/prctl.h>, <linux/securebits.h>, x86-64 / aarch64 syscall numbers.
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
# <linux/sched.h>
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MOUNT_ATTR_RDONLY, AT_RECURSIVE, AT_FDCWD = 0x1, 0x8000, -100
SYS_MOUNT_SETATTR = 442            # the same number on x86-64 and aarch64 (the unified syscall table)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 1, 4, 38, 24, 28
# Largest request (JSON) the server reads; sandbox.py refuses longer code before sending it.
MAX_REQUEST_BYTES = 1 << 17
# NOROOT and NO_SETUID_FIXUP set, KEEP_CAPS clear, all three locked: uid 0 in the user namespace gains no capability
# by execve or setuid.
SECUREBITS_LOCKED_NOROOT = 0x01 | 0x02 | 0x04 | 0x08 | 0x20
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
LAST_CAP = 63

_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _read_only_root() -> bool:
    """Every mount read-only, recursively (Linux >= 5.12); False where the kernel refuses."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    ret = _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
    return ret == 0


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def isolate_files(req: dict) -> dict:
    """Step 1 of the module docstring; returns what held (for the report)."""
    held = {"read_only_root": _read_only_root()}
    work = req["workdir"]
    disk = max(1, int(req["limits"]["disk_mb"]))
    owner = req.get("uid")
    opts = f"size={disk}m,mode=0700" + (f",uid={owner},gid={owner}" if owner is not None else "")
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    keep = [(p, False) for p in req["keep_paths"] if os.path.isdir(p)] + [(work, True)]
    fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p, _ in keep}
    hidden = []
    for top in req["hide_paths"]:
        if not os.path.isdir(top) or os.path.islink(top) or any(_inside(top, h) for h in hidden):
            continue
        if any(_inside(top, p) for p, _ in keep):   # never hide what the code needs (or its parents' insides)
            continue
        _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for path, writable in keep:
            if _inside(path, top):
                os.makedirs(path, exist_ok=True)
                _mount(f"/proc/self/fd/{fds[path]}", path, None, MS_BIND | MS_REC)
                if not writable:
                    _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        _mount(None, top, "tmpfs", MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        hidden.append(top)
    for fd in fds.values():
        os.close(fd)
    held["hidden"] = hidden
    return held


def _drop_capabilities() -> None:
    """In a user namespace whose root we are: no capability now, none by execve or setuid later."""
    _check(_libc.prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKED_NOROOT, 0, 0, 0), "securebits")
    for cap in range(LAST_CAP + 1):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            _check(-1, "drop bounding capability")
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()          # effective, permitted, inheritable x 2 words: all zero
    _check(_libc.capset(header, data), "capset")


def _user_tasks(uid: int) -> int:
    """Threads of processes owned by `uid` (what RLIMIT_NPROC counts), read from /proc."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[1]) == uid:
                    count += int(fields["Threads"])
            except (OSError, KeyError, ValueError, IndexError):
                pass
    return count


def set_limits(req: dict) -> None:
    """The worker's resource limits; RLIMIT_NPROC counts the processes of the worker's user."""
    lim = req["limits"]
    cpu = max(1, int(lim["cpu_s"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))             # SIGXCPU, then SIGKILL a second later
    memory = int(lim["memory_mb"]) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    fsize = int(lim["file_size_mb"]) * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    procs = int(lim["max_processes"])
    if req["nproc"] == "shared":     # the worker keeps its caller's user: allow that many more than it runs now
        procs += _user_tasks(os.getuid())
    resource.setrlimit(resource.RLIMIT_NPROC, (procs, procs))


_BLOCKED_EVENTS = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.", "os.putenv",
                   "os.chdir", "os.setuid", "os.setgid", "shutil.", "mmap.", "sys.addaudithook")


_READ_EVENTS = ("os.listdir", "os.scandir")
_WRITE_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod", "os.chown",
                 "os.truncate", "os.utime")


def audit_hook(allowed_read: list[str], workdir: str):
    """The fallback without namespaces: refuse network, new processes, signals, ctypes, and files outside
    the working directory (reads are also allowed inside the interpreter's own prefix, for imports).
    Python-level only: code that reaches C without raising one of these events is not stopped (sandbox.py's
    docstring says what holds)."""
    def _paths(args: tuple) -> list[str]:
        return [os.path.realpath(os.fsdecode(a)) for a in args if isinstance(a, (str, bytes))]

    def _hook(event: str, args: tuple) -> None:
        if event.startswith(_BLOCKED_EVENTS):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            mode = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
            writing = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC)) or \
                any(c in mode for c in "wax+")
            roots = [workdir] if writing else [workdir, *allowed_read]
        elif event in _READ_EVENTS:
            roots = [workdir, *allowed_read]
        elif event in _WRITE_EVENTS:
            roots = [workdir]
        else:
            return
        for path in _paths(args[:1] if event == "open" else args):
            if not any(_inside(path, r) for r in roots):
                raise PermissionError(f"sandbox: {path} is outside the working directory")
    return _hook


class _CappedOutput:
    """sys.stdout for the code: keeps the first `cap` characters, counts the rest."""

    def __init__(self, cap: int):
        self.cap, self.parts, self.kept, self.total = cap, [], 0, 0

    def write(self, text: str) -> int:
        text = str(text)
        self.total += len(text)
        if self.kept < self.cap:
            piece = text[: self.cap - self.kept]
            self.parts.append(piece)
            self.kept += len(piece)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def value(self) -> str:
        return "".join(self.parts)


def run_code(code: str, out: _CappedOutput) -> str | None:
    """Execute `code` with print() going to `out`; a last expression statement's value is printed as the
    interactive interpreter prints it. Returns the exception's last line, or None."""
    env = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(code, "<tool>", "exec")
        last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        if last is not None:
            tree.body.pop()
        exec(compile(tree, "<tool>", "exec"), env)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), env)
            if value is not None:
                print(repr(value), file=out)
        return None
    except BaseException as err:   # noqa: BLE001  (SystemExit and KeyboardInterrupt are the code's too)
        lines = (f"{type(err).__name__}: {err}" if str(err) else type(err).__name__).strip().splitlines()
        return lines[-1] if lines else type(err).__name__


def worker(req: dict, report_fd: int) -> None:
    """The child that runs the code (never returns). Processes the code forks end silently when they
    reach the end of it: only the worker itself reports."""
    me = os.getpid()
    try:
        set_limits(req)
        uid = req.get("uid")
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        elif req["mode"] == "userns":
            _drop_capabilities()
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.chdir(req["workdir"])
        os.environ.update(HOME=req["workdir"], TMPDIR=req["workdir"])   # the server's env has PATH and LANG only
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a file past RLIMIT_FSIZE is an OSError, not a kill
        out = _CappedOutput(int(req["max_output_chars"]) + 1)
        sys.stdout = sys.stderr = out
        if req.get("audit"):
            sys.addaudithook(audit_hook(req["keep_paths"], req["workdir"]))
        error = run_code(req["code"], out)
        if os.getpid() != me:
            os._exit(0)
        report = {"stdout": out.value(), "stdout_chars": out.total, "error": error}
    except BaseException as err:   # noqa: BLE001  a failure to set up is reported, never raised
        if os.getpid() != me:
            os._exit(0)
        report = {"stdout": "", "stdout_chars": 0, "error": f"sandbox setup: {type(err).__name__}: {err}"}
    try:
        data = json.dumps(report).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(report_fd, view):]
    finally:
        os._exit(0)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def supervise(req: dict, result_fd: int) -> None:
    """Step 2 of the module docstring (after step 1 with namespaces)."""
    started = time.monotonic()
    held = {}
    if req["mode"] in ("namespaces", "userns"):
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        held = isolate_files(req)
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)   # the worker may not read this process's memory or fds
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        os.close(result_fd)
        worker(req, write_end)
    os.close(write_end)
    cap, data, status, eof = int(req["max_report_bytes"]), bytearray(), None, False
    deadline = started + float(req["wall_s"])
    while status is None and time.monotonic() < deadline:
        ready, _, _ = select.select([] if eof else [read_end], [], [], 0.005)
        if ready:
            chunk = os.read(read_end, 65536)
            eof = not chunk
            if len(data) < cap:
                data += chunk[: cap - len(data)]
        done, raw = os.waitpid(pid, os.WNOHANG)
        status = raw if done else None
    timed_out = status is None
    if timed_out:   # past wall_s: the worker goes (whatever it started goes with this namespace, or the caller's group kill)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        status = os.waitpid(pid, 0)[1]
    os.set_blocking(read_end, False)
    try:
        while len(data) < cap:
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            data += chunk[: cap - len(data)]
    except BlockingIOError:
        pass
    result = {"held": held, "exit_code": os.waitstatus_to_exitcode(status), "timed_out": timed_out}
    try:
        result["worker"] = None if timed_out else json.loads(bytes(data).decode("utf-8", "replace"))
    except ValueError:
        result["worker"] = None
    _write_all(result_fd, json.dumps(result).encode())
    os.close(result_fd)


def enter_namespaces(req: dict) -> None:
    """New mount, network and PID namespaces for this call process (and a user namespace in userns mode,
    this process's uid and gid mapped to 0); mounts made here never propagate back."""
    uid, gid = os.getuid(), os.getgid()
    userns = req["mode"] == "userns"
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | (CLONE_NEWUSER if userns else 0)), "unshare")
    if userns:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)


def call(req: dict, result_fd: int) -> None:
    """One call process (module docstring); never returns."""
    os.setsid()
    os.closerange(3, result_fd)
    os.closerange(result_fd + 1, 1 << 16)
    try:
        if req["mode"] not in ("namespaces", "userns"):
            supervise(req, result_fd)
            os._exit(0)
        enter_namespaces(req)
        pid = os.fork()          # the first process of the new PID namespace: PID 1
        if pid == 0:
            # Dies with the call process; both are in the call's process group, which the caller kills anyway
            # (getppid() cannot tell whether the parent already died: it is outside this PID namespace).
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            try:
                supervise(req, result_fd)
            except BaseException as err:   # noqa: BLE001
                _report_setup_error(result_fd, err)
            os._exit(0)
        os.close(result_fd)
        os.waitpid(pid, 0)
    except BaseException as err:   # noqa: BLE001  the caller reads a report, also of a failure to set up
        _report_setup_error(result_fd, err)
    os._exit(0)


def _report_setup_error(result_fd: int, err: BaseException) -> None:
    try:
        _write_all(result_fd, json.dumps({"setup_error": f"{type(err).__name__}: {err}"}).encode())
    except OSError:
        pass


def serve(fd: int) -> None:
    """The fork server's loop (module docstring): one call process per request, until the caller closes the
    socket or dies (PR_SET_PDEATHSIG)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    sock = socket.socket(fileno=fd)

    def reap(*_):
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass

    signal.signal(signal.SIGCHLD, reap)
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST_BYTES, 1)
        if not msg:
            return
        if len(fds) != 1:
            for extra in fds:
                os.close(extra)
            sock.send(b"-1")
            continue
        req = json.loads(msg.decode())
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            sock.close()
            call(req, fds[0])
        os.close(fds[0])
        sock.send(str(pid).encode())


if __name__ == "__main__":
    serve(int(sys.argv[sys.argv.index("--serve") + 1]))
