"""The run directory: where a run lives on disk, and who may write there.

One :class:`RunDirectory` per run: it creates (or reopens, when resuming) the directory, holds it for the life of
the run (an exclusive ``flock`` on ``<run>/.lock``), refuses a directory that holds another run, compares a resumed
run's configuration with the run's own (:func:`config_changes`: only :data:`RESUME_MAY_CHANGE` keys may differ),
removes what an interrupted write left (``.*.tmp``), writes ``run.json`` (the run id) and ``config.yaml``, and writes
the checkpoints (``checkpoints/round-<r>.ckpt``, ``last.ckpt`` a link to the newest, the last ``keep_checkpoints``
kept). What goes *into* the directory each round — ``metrics.jsonl``, TensorBoard, ``summary.json``, the results
table — is :mod:`pl_fedsparse.run.writer`'s.

Every file is written atomically with the permissions the umask asks for. A directory the user cannot use (not a
directory, no permission, another run's) is one :class:`~pl_fedsparse.errors.ConfigError` line naming the parameter;
a storage failure while writing (a full disk, a quota, an I/O error, a read-only file system) is one
:class:`~pl_fedsparse.errors.StorageError` line naming the file, what failed and what to do — the previous
checkpoint is never touched by a failed write.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from pl_fedsparse.errors import STORAGE_ERRNOS, CheckpointError, ConfigError, StorageError, storage_error
from pl_fedsparse.run.atomic import atomic_link, atomic_write_text, dumps_json, refresh_umask
from pl_fedsparse.run.checkpoint import LOADED_FROM, save_checkpoint
from pl_fedsparse.run.config_diff import _show, config_changes
from pl_fedsparse.run.names import (
    _ENGINE_TMP,
    LOCK_FILE,
    RUN_FILE,
    RUN_FORMAT,
    SPECIAL_ENTRIES,
    round_checkpoint_name,
    round_checkpoints,
)
from pl_fedsparse.signals import deferred_signals

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

log = logging.getLogger(__name__)

__all__ = ['RunDirectory']


def _read_fd(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", "replace")
    except OSError:
        return ""


def _describe_holder(text: str) -> str:
    """``pid 123 on host h since 2024-01-01T10:00:00`` from a lock file's content."""
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']} since {info['started']}"
    except (ValueError, KeyError, TypeError):
        return "pid unknown"


def _os_problem(e: OSError) -> str:
    """``Not a directory: '/x'`` from an OSError (its message, without the ``[Errno N]`` prefix)."""
    text = e.strerror or type(e).__name__
    if isinstance(e, FileExistsError) and e.filename is not None and not Path(e.filename).is_dir():
        text = os.strerror(errno.ENOTDIR)  # mkdir(exist_ok=True) on a file: the problem is that it is no directory
    if e.filename is not None:
        text += f": {str(e.filename)!r}"
    return text


class RunDirectory:
    """Owns a run directory for the life of a run (see the module doc).

    Args:
        loop: the loop whose run this is (``default_root_dir``, ``overwrite``, ``keep_checkpoints``,
            ``config_text``).
    """

    def __init__(self, loop: FederationView) -> None:
        self.loop = loop
        self.run_dir: Path | None = None
        #: the run's id: made for a fresh run, taken from the checkpoint when resuming; in every checkpoint
        self.run_id: str | None = None
        #: one ``{"round", "changed"}`` per resume (``changed``: the allowed configuration differences)
        self.resumes: list[dict[str, Any]] = []
        #: completed rounds of the newest checkpoint written (or resumed from) in this directory; None: none yet
        self.checkpoint_round: int | None = None
        self._lock_fd: int | None = None

    def path(self, name: str) -> Path:
        assert self.run_dir is not None
        return self.run_dir / name

    @property
    def _root_param(self) -> str:
        return f"trainer.default_root_dir={str(self.run_dir)!r}"

    def unwritable(self, e: OSError, what: str = "writing to the run directory") -> Exception:
        """The one-line error for ``e``: a :class:`StorageError` for a storage failure (full disk, quota, I/O,
        read-only), else a :class:`ConfigError` naming ``trainer.default_root_dir``."""
        if e.errno in STORAGE_ERRNOS:
            return storage_error(e, what, self.resume_hint())
        return ConfigError(f"{self._root_param} is invalid: expected a writable directory ({_os_problem(e)})")

    def resume_hint(self) -> str:
        """What is left to continue from: the newest checkpoint (intact) and the command, or that there is none."""
        if self.run_dir is None:
            return "nothing was written"
        last = self.path("checkpoints") / "last.ckpt"
        if self.checkpoint_round is None or not last.is_file():
            return "no checkpoint was written yet: run the command again once there is space"
        config = self.path("config.yaml")
        done = self.checkpoint_round
        return (f"the last checkpoint ({done} round{'' if done == 1 else 's'} completed) is intact: resume with `pl-fed fit "
                f"{f'--config {config} ' if config.is_file() else ''}--trainer.default_root_dir {self.run_dir} "
                f"--ckpt_path {last}`")

    # ------------------------------------------------------------------------------------------------ open
    def open(self, resuming: bool, checkpoint: Mapping[str, Any] | None = None, ckpt_path: str | None = None,
             start: Callable[[int], None] | None = None) -> Path:
        """Create (or reopen, when resuming) the run directory and hold it; write ``run.json`` and the config, then
        call ``start(completed_rounds)`` (the reporter's first writes) while still inside the checks' step.

        Nothing is written into a directory that is refused: another process holding it, a directory holding
        another run (a fresh start without ``overwrite``, unless no round of it completed; a resume whose run id
        differs), or a resume whose configuration differs from the run's in a key that changes results.
        """
        self.release()
        loop = self.loop
        if checkpoint is not None and ckpt_path is None:
            ckpt_path = checkpoint.get(LOADED_FROM)
        ckpt_param = f"ckpt_path={str(ckpt_path)!r}" if ckpt_path is not None else "ckpt_path"
        completed = int(checkpoint.get("round", 0)) if checkpoint is not None else 0
        allowed: dict[str, list[Any]] = {}
        if checkpoint is not None:  # the same run? (no file system needed)
            try:
                allowed, refused = config_changes(checkpoint.get("config"), loop.config_text)
            except yaml.YAMLError as e:
                raise CheckpointError(f"{ckpt_param} is invalid: expected a checkpoint with a readable configuration "
                                      f"({' '.join(str(e).split())})") from None
            if refused:
                diffs = ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, (a, b) in refused.items())
                raise CheckpointError(f"{ckpt_param} is invalid: the configuration differs from the run's in keys "
                                      f"that change results: {diffs}; resume with the run's config.yaml")
        refresh_umask()
        # creating the directory and its lock is one step for an interrupt: it lands before or after, so nothing
        # is left that no cleanup knows of (an empty new directory, an unrecorded lock)
        with deferred_signals():
            created = self._create_and_lock()
        try:
            # from here on this process holds the directory: the checks and the first write are one step
            self.run_id = self._check_directory(resuming, checkpoint, ckpt_param)
            self._probe_checkpoints()
            self.checkpoint_round = completed if checkpoint is not None else None
            self._write_start(checkpoint, completed, allowed)
            if start is not None:
                start(completed)
        except BaseException as e:
            self.release()
            if created:
                self._remove_if_empty()
            if isinstance(e, OSError) and not isinstance(e, StorageError):  # a StorageError says it already
                raise self.unwritable(e, "starting the run") from None
            raise
        assert self.run_dir is not None  # (set by _create_and_lock)
        return self.run_dir

    def _probe_checkpoints(self) -> None:
        """An existing ``checkpoints/`` that takes no file (read-only, another owner) refused now, not after a
        round whose checkpoint could not be written: one file made and removed there."""
        folder = self.path("checkpoints")
        if folder.is_dir():
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".probe", suffix=".tmp")
            os.close(fd)
            os.unlink(probe)

    def _create_and_lock(self) -> bool:
        """Create (if needed) and lock the run directory; whether it was created. An OSError leaves nothing."""
        created = False
        try:
            if self.loop.default_root_dir:
                self.run_dir = Path(self.loop.default_root_dir)
                if self.run_dir.exists() and not self.run_dir.is_dir():
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(self.run_dir))
                created = not self.run_dir.exists()
                self.run_dir.mkdir(parents=True, exist_ok=True)
            else:
                self.run_dir, created = self._new_default_dir(), True
            self._lock()
        except OSError as e:
            if created:
                self._remove_if_empty()
            raise self.unwritable(e, "creating the run directory") from None
        return created

    def _new_default_dir(self) -> Path:
        """``runs/run-<timestamp>``, or ``-1``, ``-2``, ... when another run started in the same second."""
        base = f"runs/run-{datetime.now():%Y%m%d-%H%M%S}"
        for i in range(1000):
            candidate = Path(base if i == 0 else f"{base}-{i}")
            self.run_dir = candidate
            try:
                candidate.mkdir(parents=True)
                return candidate
            except FileExistsError:
                continue
        raise FileExistsError(errno.EEXIST, "no free run directory name", base)

    def _remove_if_empty(self) -> None:
        if self.run_dir is not None:
            try:
                self.run_dir.rmdir()
            except OSError:
                pass

    def _lock(self) -> None:
        """Hold ``<run>/.lock`` (``flock``, exclusive, not waiting); refuse when another process holds it; take a
        stale one (left by a process that died: its lock went with it) over with a warning."""
        if fcntl is None:  # pragma: no cover - no flock (Windows): no protection against concurrent runs
            return
        lock = self.path(LOCK_FILE)
        self._refuse_links()
        for _ in range(100):
            try:  # never through a link: a .lock that is a symlink would make the lock write into its target
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    self._refuse_links()  # (it became a link since the check: the same one line)
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_fd(fd)
                for _ in range(50):  # the holder writes who it is right after locking: give it a moment
                    if _describe_holder(holder) != "pid unknown":
                        break
                    time.sleep(0.01)
                    holder = _read_fd(fd)
                os.close(fd)
                raise ConfigError(
                    f"{self._root_param} is invalid: another run ({_describe_holder(holder)}) is using it; expected "
                    "a directory no other run is writing to (wait for that run to end, or choose another "
                    "--trainer.default_root_dir)") from None
            except BaseException:
                os.close(fd)
                raise
            try:  # the file may have been released and removed between our open and our flock: lock the new one
                same = os.path.samestat(os.fstat(fd), os.stat(lock))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:  # pragma: no cover
            raise ConfigError(f"{self._root_param} is invalid: expected a directory whose lock file stays put")
        self._lock_fd = fd
        try:
            previous = _read_fd(fd)
            if previous.strip():
                log.warning("%s: taking over a stale lock (%s, which ended without releasing the directory)",
                            self._root_param, _describe_holder(previous))
            info = {"pid": os.getpid(), "host": socket.gethostname(), "started": datetime.now().isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        except BaseException:
            self._unlock()
            raise

    def _refuse_links(self) -> None:
        """A run directory owns only its own files: refuse one whose special entries (:data:`SPECIAL_ENTRIES`) are
        symbolic links, before anything is opened, written or removed there (one line, naming the entry)."""
        root = self.run_dir
        assert root is not None
        for name in SPECIAL_ENTRIES:
            if (root / name).is_symlink():
                raise ConfigError(
                    f"{self._root_param} is invalid: its {name} is a symbolic link ({root / name} -> "
                    f"{os.readlink(root / name)}); expected a run directory whose own files are not links (the run "
                    "would write or remove what the link points to): remove the link or choose another directory")

    def _check_directory(self, resuming: bool, checkpoint: Mapping[str, Any] | None, ckpt_param: str) -> str:
        """Whether this run may write into the directory (checked while holding it); the run id to use."""
        loop = self.loop
        root = self.run_dir
        assert root is not None
        run_info = self._read_run_file()
        theirs = run_info.get("run_id") if run_info else None
        metrics = root / "metrics.jsonl"
        holds_run = run_info is not None or metrics.exists()
        if checkpoint is not None:
            mine = checkpoint.get("run_id") or theirs or uuid.uuid4().hex
            if theirs is not None and theirs != mine and not loop.overwrite:
                where = checkpoint.get("run_dir")
                raise ConfigError(
                    f"{ckpt_param} is invalid: it belongs to run {mine}"
                    + (f" (directory {where!r})" if where else "")
                    + f", but {self._root_param} holds run {theirs}; expected the run's own directory or a new one "
                    "(or --trainer.overwrite true to replace the run there)")
            if theirs is not None and theirs != mine:
                self._clear_previous_run()
            return str(mine)
        if holds_run and not loop.overwrite:
            if self._completed_rounds_on_disk() > 0:
                raise ConfigError(
                    f"{self._root_param} is invalid: it already holds a run; expected a new directory, "
                    f"--ckpt_path {root}/checkpoints/last.ckpt to resume it, or --trainer.overwrite true")
            log.info("%s holds a run in which no round completed (%s); starting this run over it", self._root_param,
                     f"run {theirs}" if theirs else "no run id")
        if holds_run:
            self._clear_previous_run()
        return uuid.uuid4().hex

    def _read_run_file(self) -> dict[str, Any] | None:
        p = self.path(RUN_FILE)
        try:
            info = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError):
            raise ConfigError(f"{self._root_param} is invalid: expected a readable {RUN_FILE} in it, found a "
                              "corrupted one (remove it, or use --trainer.overwrite true)") from None
        if not isinstance(info, dict):
            raise ConfigError(f"{self._root_param} is invalid: expected a readable {RUN_FILE} in it, found "
                              f"{type(info).__name__}")
        return info

    def _completed_rounds_on_disk(self) -> int:
        """How many rounds the directory's run completed, as far as its files tell (0: none)."""
        root = self.run_dir
        assert root is not None
        try:
            if self.path("metrics.jsonl").read_text(encoding="utf-8").strip():
                return 1
        except FileNotFoundError:
            pass
        except (OSError, UnicodeDecodeError):
            return 1
        kept = round_checkpoints(root / "checkpoints")
        if kept:
            return max(kept)
        if (root / "checkpoints" / "last.ckpt").exists():  # no round files: cannot tell without loading
            return 1
        return 0

    def _clear_previous_run(self) -> None:
        """Before a new run takes a directory over: remove the previous run's checkpoints, summary and TensorBoard
        events (they would mix with this run's)."""
        root = self.run_dir
        assert root is not None
        # (checkpoints/ and tensorboard/ are not links: _lock refused the directory otherwise)
        for p in round_checkpoints(root / "checkpoints").values():
            p.unlink(missing_ok=True)
        (root / "checkpoints" / "last.ckpt").unlink(missing_ok=True)
        (root / "summary.json").unlink(missing_ok=True)
        for p in (root / "tensorboard").glob("events.out.tfevents.*"):
            p.unlink(missing_ok=True)  # (a link among them is removed itself, never its target)

    def _remove_stale_tmp(self) -> None:
        root = self.run_dir
        assert root is not None
        stale = [p for d in (root, root / "checkpoints") if d.is_dir() and not d.is_symlink() for p in d.glob(".*.tmp")
                 if _ENGINE_TMP.match(p.name) and p.is_file() and not p.is_symlink()]
        for p in stale:
            p.unlink(missing_ok=True)
        if stale:
            log.info("%s: removed %d temporary file(s) left by an interrupted write", self._root_param, len(stale))

    def _write_start(self, checkpoint: Mapping[str, Any] | None, completed: int,
                     allowed: dict[str, list[Any]]) -> None:
        loop = self.loop
        self._remove_stale_tmp()
        info = self._read_run_file()
        if info is None or info.get("run_id") != self.run_id:
            atomic_write_text(self.path(RUN_FILE), dumps_json(
                {"format": RUN_FORMAT, "run_id": self.run_id,
                 "created": datetime.now().isoformat(timespec="seconds")}) + "\n")
        if checkpoint is not None:
            before = json.loads(checkpoint["resumes"]) if isinstance(checkpoint.get("resumes"), str) else []
            self.resumes = [*before, {"round": completed, "changed": allowed}]
            if allowed:
                log.info("resuming run %s at round %d with changed settings: %s", self.run_id, completed,
                         ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, (a, b) in allowed.items()))
        else:
            self.resumes = []
        if loop.config_text is not None:
            atomic_write_text(self.path("config.yaml"), loop.config_text)

    def save_checkpoint(self, state: dict[str, Any], path: str | Path | None = None) -> Path:
        """Write a federation checkpoint atomically. Without ``path``: ``checkpoints/round-<r>.ckpt`` (r = completed
        rounds), then ``checkpoints/last.ckpt`` replaced by a link to it (a kill in between leaves the previous
        ``last.ckpt``: a consistent pair), then the round files older than the last ``loop.keep_checkpoints``
        removed (never one newer than this round: a run resumed from an earlier round rewrites those)."""
        if path is not None:
            try:
                save_checkpoint(path, state)
            except OSError as e:
                if e.errno in STORAGE_ERRNOS:
                    raise storage_error(e, "writing the checkpoint", "nothing else was changed") from None
                raise ConfigError(f"path={str(path)!r} is invalid: expected a writable checkpoint path "
                                  f"({_os_problem(e)})") from None
            return Path(path)
        directory = self.path("checkpoints")
        completed = int(state["round"])
        target = directory / round_checkpoint_name(completed)
        try:
            save_checkpoint(target, state)
            atomic_link(target, directory / "last.ckpt")
            older = sorted(r for r in round_checkpoints(directory) if r < completed)
            keep = max(1, int(getattr(self.loop, "keep_checkpoints", 2)))
            for r in older[:max(0, len(older) - (keep - 1))]:
                (directory / round_checkpoint_name(r)).unlink(missing_ok=True)
        except OSError as e:
            raise self.unwritable(e, "writing the checkpoint") from None
        self.checkpoint_round = completed
        return directory / "last.ckpt"

    def release(self) -> None:
        """Give the run directory up (end of the run, or an error; idempotent): remove and unlock ``.lock``."""
        self._unlock()

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        try:
            if self.run_dir is not None:  # remove it while still holding it: a waiting opener re-checks the inode
                lock = self.path(LOCK_FILE)
                try:
                    if os.path.samestat(os.fstat(fd), os.stat(lock)):
                        lock.unlink()
                except OSError:
                    pass
        finally:
            os.close(fd)  # closing the last descriptor releases the flock
