"""Run a function in a child forked from the test process, bounded, and bring back what it saw.

Two ways to fork, as applications do: a bare ``os.fork()`` (gunicorn,
Celery's prefork pool) and ``multiprocessing.get_context("fork")``.  The
child runs ``fn`` and sends back ``fn``'s result (a JSON value); a child that
does not answer within ``timeout_s`` is killed and the test fails: the point
of the callers is that nothing in the child waits.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import select
import signal
import warnings
from collections.abc import Callable
from typing import Any

FORK_KINDS = ("os.fork", "multiprocessing")


def in_forked_child(kind: str, fn: Callable[[], Any], *, timeout_s: float = 20.0) -> Any:
    """``fn()`` run in a child forked now (``kind``: one of :data:`FORK_KINDS`); its JSON result."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded process forks" (3.12+)
        if kind == "os.fork":
            return _os_fork(fn, timeout_s)
        if kind == "multiprocessing":
            return _multiprocessing_fork(fn, timeout_s)
    raise ValueError(kind)


def _answer(fn: Callable[[], Any]) -> bytes:
    try:
        return json.dumps({"result": fn()}).encode()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        return json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()


def _os_fork(fn: Callable[[], Any], timeout_s: float) -> Any:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer, then leave without running the parent's exit handlers
        try:
            os.close(read_end)
            os.write(write_end, _answer(fn))
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], timeout_s)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"the forked child gave no answer within {timeout_s}s")
        chunks = []
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    return _result(b"".join(chunks))


def _multiprocessing_child(fn: Callable[[], Any], conn: Any) -> None:
    conn.send_bytes(_answer(fn))
    conn.close()


def _multiprocessing_fork(fn: Callable[[], Any], timeout_s: float) -> Any:
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_multiprocessing_child, args=(fn, sender), daemon=True)
    child.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            child.kill()
            raise AssertionError(f"the multiprocessing child gave no answer within {timeout_s}s")
        data = receiver.recv_bytes()
    finally:
        receiver.close()
        child.join(timeout_s)
        if child.is_alive():
            child.kill()
            raise AssertionError("the multiprocessing child did not exit after answering")
    return _result(data)


def _result(data: bytes) -> Any:
    answer = json.loads(data)
    if "error" in answer:
        raise AssertionError(f"the forked child failed: {answer['error']}")
    return answer["result"]
