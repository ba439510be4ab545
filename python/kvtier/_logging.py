"""Routes kvtier's C++ log (core/log.h) to Python's ``logging``.

Lines go to the ``kvtier.<component>`` loggers (e.g. ``kvtier.storage.disk``); kvtier's own
level (``kvtier.set_log_level``, or ``KVTIER_LOG_LEVEL``) decides what is produced at all.
A daemon thread moves lines from kvtier's bounded queue into ``logging``; a line that
finds the queue full drops the oldest, and the next batch reports how many were dropped.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

from . import _native

_started = False
_lock = threading.Lock()


_stop = threading.Event()
_thread = None


def _pump() -> None:
    root = logging.getLogger("kvtier")
    while not _stop.is_set():
        try:
            lines, dropped = _native._next_log_lines(0.5)
        except Exception:  # noqa: BLE001 - interpreter shutting down
            return
        if dropped:
            root.warning("%d kvtier log lines were dropped (the queue was full)", dropped)
        for level, component, message in lines:
            logging.getLogger("kvtier." + component.replace("/", ".")).log(level, "%s", message)


def _start_pump() -> None:
    global _thread
    _thread = threading.Thread(target=_pump, name="kvtier-log", daemon=True)
    _thread.start()


def install() -> None:
    """Starts routing (idempotent; kvtier's __init__ calls it)."""
    global _started
    with _lock:
        if _started:
            return
        _native._install_log_sink()
        _start_pump()
        atexit.register(_shutdown)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_fork_in_child)
        _started = True


def _after_fork_in_child() -> None:
    # The pump thread does not survive fork(): without a new one the child's lines were queued and never
    # delivered. The queue is replaced too: a thread of the parent may have held its mutex at the fork.
    global _lock, _stop
    _lock = threading.Lock()
    _stop = threading.Event()
    _native._reset_log_queue_after_fork()
    _start_pump()


def _shutdown() -> None:
    # At exit, before the interpreter finalizes: a daemon thread that wakes from the native wait
    # after that point is ended by CPython inside C++ frames (std::terminate). Deliver what is
    # queued, then let the thread leave its loop.
    _stop.set()
    _native._stop_log_pump()
    if _thread is not None:
        _thread.join(timeout=2.0)


def flush(timeout: float = 1.0) -> None:
    """Waits until the lines logged so far reached ``logging`` (tests)."""
    import time

    marker = f"flush-{time.monotonic_ns()}"
    seen = threading.Event()

    class _Watch(logging.Handler):
        def emit(self, record):
            if record.getMessage() == marker:
                seen.set()

    logger = logging.getLogger("kvtier.python.flush")
    handler = _Watch()
    logger.addHandler(handler)
    try:
        _native._log("info" if _native.log_level() in ("debug", "info") else "error", "python/flush", marker)
        seen.wait(timeout)
    finally:
        logger.removeHandler(handler)
