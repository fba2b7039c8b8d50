"""A local Ray instance the engine starts itself: on the loopback interface only, its processes stopped by a sentinel
when the driver dies however it dies, the driver's signal handlers kept, and a cluster address checked for
reachability before Ray is asked to join it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

from pl_fedsparse.errors import ConfigError

__all__ = ["LOOPBACK"]


# ------------------------------------------------------------------------------------------------ Ray
def _check_reachable(address: str | None, timeout: float = 5.0) -> None:
    """Refuse a ``host:port`` cluster address nobody listens on, at once (``ray.init`` would retry for minutes)."""
    if address is None or address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"trainer.executor.address={address!r} is invalid: expected 'auto', 'host:port', "
                          "'ray://host:port' or null for a local instance")
    import socket

    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise ConfigError(f"trainer.executor.address={address!r} is invalid: expected a reachable Ray cluster "
                          f"(ray start --head on that node), or null for a local one ({e.strerror or e})") from None


#: the address a local Ray instance started by :class:`RayExecutor` binds to
LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """Put this process's SIGTERM and SIGINT handlers back after the block: ``ray.init`` installs a native failure
    handler for SIGTERM that dumps a stack trace and aborts (exit -6), which would bypass ``pl-fed``'s clean stop
    (exit 143, the resume command, the workers stopped)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def _start_sentinel(ray: Any) -> subprocess.Popen[bytes] | None:
    """Start ``ray_sentinel.py`` for the local Ray instance this process just started: when this process dies, even
    by SIGKILL, the pipe to the sentinel closes and it stops the instance's processes (Ray leaves its GCS, raylet and
    agents running otherwise). Linux only (it reads ``/proc``); ``None`` elsewhere or when the session directory is
    unknown."""
    if not os.path.isdir("/proc/self"):
        return None
    try:
        session_dir = ray._private.worker._global_node.get_session_dir_path()
    except AttributeError:
        return None
    from pl_fedsparse.executors import (
        ray_sentinel as _ray_sentinel,  # (its file is run as a script; found by import, wherever it lives)
    )

    script = os.path.abspath(_ray_sentinel.__file__)
    return subprocess.Popen([sys.executable, "-S", script, session_dir], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)


@contextlib.contextmanager
def _loopback_node(local: bool) -> Iterator[None]:
    """While ``ray.init`` starts a local instance: keep its node address on the loopback interface.

    ``ray.init(_node_ip_address="127.0.0.1")`` alone is not enough on Linux: Ray replaces a loopback node address
    by the machine's network address (``services.resolve_ip_for_localhost``) unless its single-machine mode is on
    (``ray_constants.ENABLE_RAY_CLUSTER`` false, what ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` sets at import).
    With the node address ``127.0.0.1``, the GCS, the raylet, the workers and the driver bind their servers to
    ``127.0.0.1`` instead of every interface. The flag is read only while the node starts (processes started
    later get the node address from the raylet), so it is switched for the ``ray.init`` call and restored.
    """
    if not local:
        yield
        return
    try:
        from ray._private import ray_constants
    except ImportError:  # another Ray layout: the node address alone
        yield
        return
    missing = object()
    before = getattr(ray_constants, "ENABLE_RAY_CLUSTER", missing)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if before is missing:
            del ray_constants.ENABLE_RAY_CLUSTER
        else:
            ray_constants.ENABLE_RAY_CLUSTER = before


#: Ray's notice, at every ``ray.init`` that starts a local instance, that token authentication is on (its default for
#: local instances since Ray 2.59) and how to turn it off
_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"


class _DropTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_TOKEN_NOTICE)


@contextlib.contextmanager
def _quiet_local_start(local: bool) -> Iterator[None]:
    """While ``ray.init`` starts a local instance: leave out Ray's notice that token authentication is on.

    The notice is about the protection this instance has anyway (on, with a token Ray generates, and the instance
    bound to 127.0.0.1 besides: ``_loopback_node``), and tells the user how to turn it off. Ray prints it only when
    ``RAY_AUTH_MODE`` is unset (its documented switch), but that variable cannot be set here: Ray reads its
    configuration when imported, and a driver that sets ``RAY_AUTH_MODE=token`` afterwards starts an instance that
    rejects the driver itself. So only that one record of Ray's logger is dropped, for the ``ray.init`` call:
    every other warning, and the notice that authentication is *off* (``RAY_AUTH_MODE=disabled``), still shows.
    A cluster given by ``address`` is left as it is.
    """
    if not local:
        yield
        return
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    quiet = _DropTokenNotice()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
