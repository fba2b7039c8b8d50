"""Stops a local Ray instance's processes when the driver that started it dies, however it dies (SIGKILL too).

Run by :class:`~pl_fedsparse.executors.RayExecutor` as ``python _ray_sentinel.py <session_dir>`` with its standard
input a pipe from the driver. It imports nothing of pl_fedsparse (no torch: a few MB of memory) and blocks reading
that pipe. The read returns at end of file, which happens when the driver closes the pipe at teardown or when the
kernel closes it because the driver died. Then it ends the session's processes: the Ray node processes, whose
command lines name the session directory (GCS, raylet, monitor, log monitor, dashboard), and every process below them
(workers and agents, which rename themselves ``ray::…``). It sends SIGTERM first, then SIGKILL to what is left after
a grace period. After a normal teardown (``ray.shutdown()``) nothing is left, and it simply exits. Linux only, because
it reads ``/proc``.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

GRACE_S = 3.0
REFRESH_S = 1.0


def _ppids() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
            out[int(d)] = int(stat.rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _stat(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != b"Z"  # a zombie has ended


def _start_time(pid: int) -> bytes | None:
    st = _stat(pid)
    return st[19] if st is not None and len(st) > 19 else None  # field 22 of /proc/<pid>/stat


def session_processes(session_dir: str) -> list[int]:
    """The session's node processes (their command line names ``session_dir``) and all their descendants."""
    me, key = os.getpid(), session_dir.encode()
    ppids = _ppids()
    roots = [p for p in ppids if p != me and key in _cmdline(p)]
    children: dict[int, list[int]] = {}
    for p, pp in ppids.items():
        children.setdefault(pp, []).append(p)
    found, todo = set(), list(roots)
    while todo:
        p = todo.pop()
        if p in found or p == me:
            continue
        found.add(p)
        todo.extend(children.get(p, []))
    return sorted(found)


class Watch:
    """The session's processes seen so far, by (pid, start time): a process whose parent died first (and was
    reparented) is still known, and a reused pid is not mistaken for it."""

    def __init__(self, session_dir: str) -> None:
        self.session_dir, self.known = session_dir, {}  # type: ignore[var-annotated]

    def refresh(self) -> None:
        for p in session_processes(self.session_dir):
            t = _start_time(p)
            if t is not None:
                self.known[p] = t
        self.known = {p: t for p, t in self.known.items() if _start_time(p) == t and _alive(p)}

    def targets(self) -> list[int]:
        self.refresh()
        return sorted(self.known)


def stop(session_dir: str, grace_s: float = GRACE_S, watch: Watch | None = None) -> list[int]:
    """SIGTERM the session's processes, SIGKILL what is left after ``grace_s``; returns the pids signalled."""
    watch = watch or Watch(session_dir)
    targets = watch.targets()
    starts = {p: watch.known[p] for p in targets}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in targets:
            if _alive(p) and _start_time(p) == starts[p]:
                try:
                    os.kill(p, sig)
                except OSError:
                    pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in targets):
            time.sleep(0.1)
    return targets


def main() -> None:
    session_dir = sys.argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole process group: outlive the driver
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch = Watch(session_dir)
    fd = sys.stdin.fileno()
    while True:  # the driver never writes: a read returns b"" at end of file (pipe closed or driver dead)
        ready, _, _ = select.select([fd], [], [], REFRESH_S)
        if ready and not os.read(fd, 65536):
            break
        watch.refresh()  # Ray's agents are the raylet's children: known before a dying raylet orphans them
    stop(session_dir, watch=watch)


if __name__ == "__main__":
    main()
