"""The worker processes of ``shardio pack`` with ``--workers`` > 1, and the :class:`Task` unit.

fork, not spawn: the workers inherit the imported modules (no re-import).  Each is forked before
the first task is planned and reads its tasks from a pipe of its own; it reports each shard (a
pickled :class:`~shardio.formats.WrittenShard` and skip counts) or its error on a second pipe.
Messages on both pipes are an 8-byte little-endian length, then the body: ``marshal`` of plain
tuples for a task (~5x faster than pickling the samples), ``pickle`` for a report.  Closing a
worker's task pipe tells it to exit once it has written the shard in hand, so a worker whose
parent died reads end of file and exits too.
"""

from __future__ import annotations

import marshal
import os
import select
import signal
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ._fsutil import set_pdeathsig
from ._scan import Sample
from .errors import ShardioError
from .formats import WrittenShard

__all__ = ["Task", "run_forked"]

# What a worker does with a task: write its shard, return ``(WrittenShard, skip counts)``.
Write = Callable[["Task"], tuple[WrittenShard, Counter[str]]]


@dataclass
class Task:
    """One shard to write: its global number, final path, samples and fingerprint, and how
    its files are read (``shardio.packer._ReadAhead``): ``read_threads`` threads when more than
    one (the scan found the source slow), one when 1, and 0 for "time the first reads and use
    threads if they are slow"."""

    number: int
    final: str
    samples: list[Sample]
    fingerprint: str
    read_threads: int = 1


def _send(fd: int, obj: Any) -> None:
    import pickle  # (imported by run_forked before it forks: a one-worker pack needs none)

    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(len(data).to_bytes(8, "little") + data)
    while view:
        view = view[os.write(fd, view):]


def _task_message(task: Task) -> bytes:
    """A task as a worker receives it: ``marshal`` of plain tuples (~5x faster than pickling
    the samples), behind an 8-byte length."""
    data = marshal.dumps((task.number, task.final, task.fingerprint,
                          [(s.key, s.files, s.label) for s in task.samples], task.read_threads))
    return len(data).to_bytes(8, "little") + data


def _read_exactly(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd``, or None at end of file before the first."""
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            if got:
                raise EOFError(f"pipe closed {got} bytes into a {n}-byte message")
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _child(tasks_fd: int, write: Write, fd: int, parent: int) -> None:
    """A forked worker: write each task read from ``tasks_fd`` (until end of file), report each
    shard (or the error) on ``fd``; never returns.  It dies with its parent (SIGKILL): a pack
    killed and rerun at once, with other options, must not see this worker publish a shard of
    the old job over the new one's (its temp file is then swept by the rerun)."""
    code = 0
    set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    try:
        while (head := _read_exactly(tasks_fd, 8)) is not None:
            body = _read_exactly(tasks_fd, int.from_bytes(head, "little"))
            if body is None:
                raise EOFError("pipe closed between a task's length and its body")
            number, final, fingerprint, rows, read_threads = marshal.loads(body)
            task = Task(number, final, [Sample(*r) for r in rows], fingerprint, read_threads)
            _send(fd, write(task))
    except BaseException as exc:  # noqa: BLE001  (KeyboardInterrupt too: the parent re-raises it)
        code = 1
        try:
            tb = ""
            try:
                import traceback

                tb = "".join(traceback.format_exception(exc))
            except Exception:  # noqa: BLE001, S110  (the traceback is only a nicety)
                pass
            try:
                _send(fd, (exc, tb))
            except Exception:  # noqa: BLE001  (an exception that does not pickle)
                _send(fd, (ShardioError(f"pack worker failed: {exc!r}"), tb))
        except BaseException:  # noqa: BLE001, S110  (parent gone: it sees the exit status)
            pass
    finally:
        os._exit(code)


class _Worker:
    """The parent's end of a forked worker: its pid, its task pipe and the messages it sent."""

    def __init__(self, pid: int, fd: int, tasks_fd: int) -> None:
        self.pid, self.fd, self.tasks_fd = pid, fd, tasks_fd
        self.buf = b""
        self.eof = False
        self.busy = False  # a task was sent and its report has not come back
        self.status: int | None = None  # wait status, once reaped
        os.set_blocking(fd, False)

    def give(self, task: Task) -> bool:
        """Send ``task`` (the worker is idle: it reads the message as it arrives); False if the
        worker is gone."""
        view = memoryview(_task_message(task))
        try:
            while view:
                view = view[os.write(self.tasks_fd, view):]
        except BrokenPipeError:
            return False
        self.busy = True
        return True

    def finish(self) -> None:
        """No more tasks: the worker exits once it has written the one in hand."""
        if self.tasks_fd >= 0:
            os.close(self.tasks_fd)
            self.tasks_fd = -1

    def poll(self, block: bool) -> list[Any]:
        """Messages received so far; with ``block``, every message until the worker exits."""
        import pickle

        while not self.eof:
            if block:
                _wait_readable([self.fd])
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                if block:
                    continue
                break
            if not chunk:
                self.eof = True
                break
            self.buf += chunk
        out = []
        while len(self.buf) >= 8:
            n = int.from_bytes(self.buf[:8], "little")
            if len(self.buf) < 8 + n:
                break
            out.append(pickle.loads(self.buf[8 : 8 + n]))
            self.buf = self.buf[8 + n :]
        return out

    def reap(self) -> int:
        if self.status is None:
            self.finish()
            os.close(self.fd)
            self.status = os.waitpid(self.pid, 0)[1]
        return self.status


def _wait_readable(fds: list[int]) -> None:
    """Wait until one of ``fds`` can be read (poll, not select: a pack with hundreds of workers
    has descriptors past select's limit of 1024)."""
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN)
    p.poll()


def run_forked(tasks: Iterable[Task], procs: int, write: Write,
               done: Callable[[WrittenShard, Counter[str]], None]) -> None:
    """Write ``tasks`` in ``procs`` forked workers: ``write(task)`` in a worker, then
    ``done(*result)`` here, in the order the workers finish.

    fork, not spawn: the workers inherit the imported modules (no re-import).  They are forked
    before the first task is planned, so each task is sent to an idle worker over its pipe
    (``marshal`` of plain tuples, ~1 ms for 3,000 samples).  This process scans (iterating
    ``tasks``), hands out tasks and collects reports; it writes nothing, so a worker gets its
    next task the moment it reports the last.  It stops scanning while ``2 * procs`` tasks wait,
    which bounds the memory the plan holds.  No thread runs at fork time (the progress bar has
    no monitor thread).  The first error stops the handing out; the workers finish the shard in
    hand, then the error is raised here, typed as the worker raised it (its traceback added as
    a note).  A worker whose parent dies is killed with it (``PR_SET_PDEATHSIG``).
    """
    import pickle  # noqa: F401  (here, not at import: a one-worker pack never needs it)

    workers: list[_Worker] = []
    queue: deque[Task] = deque()
    error: BaseException | None = None

    def collect(block: bool) -> None:
        """Take the workers' reports; reap those that exited.  With ``block``, first wait until
        one of them has something to say."""
        nonlocal error
        live = [wk for wk in workers if not wk.eof]
        if block and live:
            _wait_readable([wk.fd for wk in live])
        for wk in live:
            for msg in wk.poll(False):
                wk.busy = False
                if isinstance(msg[0], BaseException):
                    if error is None:
                        error = msg[0]
                        if msg[1] and hasattr(error, "add_note"):  # Python 3.11+
                            error.add_note(f"raised in pack worker {wk.pid}:\n{msg[1]}")
                else:
                    done(*msg)
            if wk.eof:
                status = wk.reap()
                if error is None and (status != 0 or wk.busy):
                    error = ShardioError(
                        f"a pack worker (pid {wk.pid}) died ({_status_text(status)}) before it "
                        "finished; rerun the same command to resume"
                    )

    def hand_out() -> None:
        for wk in workers:
            if not queue or error is not None:
                return
            if wk.busy or wk.eof:
                continue
            if wk.give(queue[0]):
                queue.popleft()
            else:
                collect(True)  # it is gone: its end of file (and the error) comes next

    try:
        for _ in range(procs):
            r, w = os.pipe()
            tr, tw = os.pipe()
            parent = os.getpid()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                os.close(tw)
                for wk in workers:  # a sibling's task pipe must close when the parent closes it
                    os.close(wk.tasks_fd)
                    os.close(wk.fd)
                _child(tr, write, w, parent)
            os.close(w)
            os.close(tr)
            workers.append(_Worker(pid, r, tw))
        for task in tasks:  # with the streaming pack, the scan runs inside this loop
            collect(False)
            queue.append(task)
            hand_out()
            while len(queue) >= 2 * procs and error is None:  # far ahead of the writers
                collect(True)
                hand_out()
            if error is not None:
                break
        while error is None and (queue or any(wk.busy for wk in workers)):
            hand_out()
            collect(True)
        for wk in workers:
            wk.finish()
        while any(not wk.eof for wk in workers):  # the workers exit (after an error: once
            collect(True)  # they have finished the shard in hand)
    except BaseException as exc:  # noqa: BLE001  (re-raised below, once the workers are reaped)
        if error is None:
            error = exc
        for wk in workers:
            wk.finish()
            try:
                wk.poll(True)  # they finish the shard in hand (published, not counted: we raise)
            except BaseException:  # noqa: BLE001, S110  (a second Ctrl-C: stop waiting)
                pass
    finally:
        for wk in workers:
            if wk.status is not None:
                continue
            status = wk.reap()
            if error is None and status != 0:
                error = ShardioError(
                    f"a pack worker (pid {wk.pid}) died ({_status_text(status)}) before it "
                    "finished; rerun the same command to resume"
                )
    if error is not None:
        raise error


def _status_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"

