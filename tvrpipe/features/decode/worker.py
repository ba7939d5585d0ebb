"""The decoder process: :class:`DecodeWorker` runs the readers in a killable child with a per-video
wall-clock timeout (decord can spin forever in native code; the package docstring)."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from tvrpipe.errors import VideoError
from tvrpipe.features.decode.failure import DecodeFailure, describe
from tvrpipe.features.decode.readers import READERS, OpenFile, decode_moments, decode_with_readers
from tvrpipe.features.decode.sampling import DecodedVideo, check_sizes

log = logging.getLogger(__name__)

# A new decoder process needs a while to import numpy, PyAV and decord, more on a busy host;
# this does not count against the per-video timeout.
_STARTUP_TIMEOUT_S = 120.0


class DecodeWorker:
    """A decoder child process with a per-video wall-clock timeout.

    The child is a fresh Python interpreter (``subprocess`` + exec, never a bare fork: the
    parent may hold threads, e.g. Ray's or torch's; and unlike multiprocessing's "spawn" it does
    not re-import the caller's ``__main__``, so scripts need no ``if __name__ == "__main__"``
    guard). It starts on the first :meth:`decode`, imports PyAV and decord itself, and serves
    requests over a socket pair with pickled messages. A request that takes longer than
    ``timeout_s`` gets the child killed; a request whose child dies (a crash in a codec) gets it
    reaped. Either way the request is retried once in a fresh child with PyAV alone, since these
    are decord's known failure modes (it spins forever on files whose frame count lies); if that
    fails too the video fails with kind ``"timeout"`` or ``"unreadable"``. So a hopeless video
    costs at most ``2 * timeout_s``. The child exits by itself when the parent goes away. One
    request at a time: use one worker per thread.

    Args:
        timeout_s: Wall-clock limit for one decode attempt, in seconds (child start-up excluded).

    Example:
        >>> with DecodeWorker(timeout_s=60) as worker:  # doctest: +SKIP
        ...     video = worker.decode("video0.mp4", 12, 224)
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None  # our end of the socket pair
        self._finalizer: weakref.finalize | None = None
        self._stopped = False  # set by stop(): no child is started again

    @property
    def pid(self) -> int | None:
        """Process id of the running child, or None before the first decode / after close."""
        return self._proc.pid if self._proc is not None else None

    def decode(
        self,
        path: str | os.PathLike[str],
        num_frames: int,
        image_size: int,
        start_s: float | None = None,
        end_s: float | None = None,
        offsets: np.ndarray | None = None,
    ) -> DecodedVideo:
        """Decode one video in the child process; same arguments and result as :func:`decode_video`.

        Raises:
            DecodeFailure: As :func:`decode_video`, plus kind ``"timeout"`` when no attempt
                finished within ``timeout_s``, and ``"unreadable"`` when the decoder died.
            VideoError: The child process could not start (an environment problem).
        """
        check_sizes(num_frames, image_size)
        request = (str(path), int(num_frames), int(image_size), start_s, end_s)
        offsets = None if offsets is None else np.asarray(offsets, dtype=np.float64)
        video, lost = self._attempt(request, READERS, offsets)
        if video is not None:
            return video
        log.debug("retrying with PyAV alone after: %s", lost)
        video, lost_again = self._attempt(request, ("pyav",), offsets)
        if video is not None:
            return video
        detail = f"{lost.detail}; then with PyAV alone: {lost_again.detail}"
        raise DecodeFailure(lost_again.kind, path, detail)

    def decode_moments(
        self, path: str | os.PathLike[str], num_frames: int, image_size: int,
        bounds: list[tuple[float | None, float | None]],
    ) -> list[DecodedVideo | DecodeFailure]:
        """Several clips of one file decoded in the child from one open of it (:func:`decode_moments`), within
        ``timeout_s`` per clip; a child lost on the way (timeout, crash) gets each clip decoded alone by
        :meth:`decode`, with its own timeout and PyAV retry, so a hopeless file fails each clip as it would alone.
        The child keeps the file open after the call: the next call of the same file decodes on from where this
        one stopped (send a file's moments in time order).

        Returns:
            Each clip's frames or its :class:`DecodeFailure`, in the order of ``bounds``.
        """
        check_sizes(num_frames, image_size)
        bounds = [(None if a is None else float(a), None if b is None else float(b)) for a, b in bounds]
        results, lost = self._send((_MOMENTS, str(path), int(num_frames), int(image_size), bounds), str(path),
                                   "decord, moments", self.timeout_s * max(1, len(bounds)))
        if results is not None:
            return results
        log.debug("decoding the moments of %s alone after: %s", path, lost)
        out: list[DecodedVideo | DecodeFailure] = []
        for start, end in bounds:
            try:
                out.append(self.decode(path, num_frames, image_size, start, end))
            except DecodeFailure as failure:
                out.append(failure)
        return out

    def start(self) -> None:
        """Start the child process now rather than at the first decode (it imports its readers meanwhile)."""
        self._ensure_started()

    def stop(self) -> None:
        """Kill the child at once and start no other: safe while another thread waits on a decode here, which
        then ends at once (its video failed with :class:`~tvrpipe.errors.VideoError`, its retry refused)."""
        self._stopped = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()  # the waiting thread sees the socket close and reaps the child itself

    def close(self) -> None:
        """Stop the child process (politely, then by force). The worker stays usable."""
        if self._finalizer is not None:
            self._finalizer()  # runs _shutdown once
        self._proc = self._conn = self._finalizer = None

    def __enter__(self) -> DecodeWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _attempt(
        self, request: tuple, readers: tuple[str, ...], offsets: np.ndarray | None
    ) -> tuple[DecodedVideo, None] | tuple[None, DecodeFailure]:
        """One request in the child. Failures the child reports are raised; losing the child
        (timeout, crash) is returned, so that the caller can retry."""
        return self._send((*request, readers, offsets), request[0], "+".join(readers), self.timeout_s)

    def _send(self, message: tuple, path: str, how: str, timeout_s: float) -> tuple[Any, None] | tuple[None, DecodeFailure]:
        """One message to the child and its reply within ``timeout_s``: ``(result, None)``, or ``(None, failure)``
        when the child was lost (killed at the timeout, or died); an error the child reports is raised."""
        conn = self._ensure_started()
        try:
            conn.send(message)
        except OSError:  # the child died between requests: start another and resend once
            self._kill()
            conn = self._ensure_started()
            conn.send(message)
        if not conn.poll(timeout_s):
            self._kill()
            detail = f"no result within {timeout_s:g} s ({how}); decoder process killed"
            return None, DecodeFailure("timeout", path, detail)
        try:
            status, payload = conn.recv()
        except (EOFError, OSError):
            code = self._kill()
            return None, DecodeFailure("unreadable", path, f"decoder process died (exit code {code}) ({how})")
        if status == "ok":
            return payload, None
        raise payload

    def _ensure_started(self) -> Connection:
        if self._proc is not None and self._proc.poll() is None:
            return self._conn
        self._kill()
        if self._stopped:
            raise VideoError("the decoder was stopped")
        ours, theirs = socket.socketpair()
        with theirs:
            # The child imports tvrpipe from wherever this process does.
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD_MAIN, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                # decord and FFmpeg print their own lines for a bad file; its failure is recorded
                # and reported by tvrpipe, so their lines show only with -v (INFO logging)
                stderr=None if logging.getLogger().getEffectiveLevel() <= logging.INFO else subprocess.DEVNULL,
            )
        conn = Connection(ours.detach())
        finalizer = weakref.finalize(self, _shutdown, proc, conn, True)
        try:
            if not conn.poll(_STARTUP_TIMEOUT_S):
                raise VideoError(f"the decoder process did not start within {_STARTUP_TIMEOUT_S:g} s")
            status, payload = conn.recv()
            if status != "ready":
                raise payload
        except BaseException as exc:
            finalizer.detach()
            code = _shutdown(proc, conn, False)
            if isinstance(exc, (EOFError, OSError)):
                raise VideoError(f"the decoder process exited while starting (exit code {code})") from None
            raise
        self._proc, self._conn, self._finalizer = proc, conn, finalizer  # only a ready child
        if self._stopped:  # stopped while this child started
            self._kill()
            raise VideoError("the decoder was stopped")
        return conn

    def _kill(self) -> int | None:
        """Stop the child at once (no goodbye); return its exit code."""
        proc, conn = self._proc, self._conn
        if self._finalizer is not None:
            self._finalizer.detach()
        self._proc = self._conn = self._finalizer = None
        return _shutdown(proc, conn, False) if proc is not None else None


_MOMENTS = "\x00moments"  # first field of a decode_moments request (a path never holds a NUL)
_CHILD_MAIN = ("import sys; from tvrpipe.features.decode.worker import _worker_main; "
               "_worker_main(*sys.argv[1:])")


def _worker_main(fd: str, parent_pid: str) -> None:
    """Body of the decoder process: serve (path, F, S, start_s, end_s, readers, offsets) requests
    arriving on the socket ``fd``; exit when the parent closes it or dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    conn = Connection(int(fd))
    threading.Thread(target=_exit_with_parent, args=(int(parent_pid),), daemon=True).start()
    try:
        import av  # noqa: F401
        import decord

        decord.logging.set_level(decord.logging.QUIET)  # failures are reported via DecodeFailure
    except Exception as exc:
        conn.send(("error", VideoError(f"the decoder process cannot import its readers: {describe(exc)}")))
        return
    conn.send(("ready", None))
    # the file of the last moments request stays open: a long file's next moments decode on from where they
    # stopped, without opening (indexing) the file again
    reader = OpenFile()
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if request is None:
            return
        try:
            if request[0] == _MOMENTS:
                reply: tuple[str, Any] = ("ok", decode_moments(*request[1:], reader=reader))
            else:
                reader.close()  # another kind of request: the moments of that file are done
                reply = ("ok", decode_with_readers(*request))
        except Exception as exc:  # every error goes back to the parent
            reader.close()
            reply = ("error", exc if _picklable(exc) else VideoError(describe(exc)))
        conn.send(reply)


def _exit_with_parent(parent_pid: int) -> None:
    # A parent killed with SIGKILL cannot stop us, and a decode stuck in native code never
    # reads the closed socket; this thread still runs (decord's ctypes calls release the GIL).
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def _picklable(obj: object) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


def _shutdown(proc: subprocess.Popen, conn: Connection, polite: bool) -> int | None:
    """Stop a decoder process: ask it to exit (if polite), then SIGTERM, then SIGKILL."""
    if polite and proc.poll() is None:
        with contextlib.suppress(OSError):
            conn.send(None)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.5)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    conn.close()
    return proc.returncode
