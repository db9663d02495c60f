"""Worker output for ``horovodrun``: each worker's stdout and stderr copied to ours as
it comes, line by line with Horovod's ``[rank]<stdout>:`` prefix (and the time, with
--prefix-output-with-timestamp), and into --output-filename's per-rank files."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from typing import IO, Dict, Optional


def log(message: str) -> None:
    """Print a one-line ``horovodrun:`` message to stderr."""
    sys.stdout.flush()
    sys.stderr.write(f"horovodrun: {message}\n")
    sys.stderr.flush()


class TextSink:
    """A byte stream over a text stream that has no ``buffer`` (Jupyter's)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, data: bytes) -> int:
        self._stream.write(data.decode("utf-8", "replace"))
        return len(data)

    def flush(self) -> None:
        self._stream.flush()


class OutputForwarder:
    """Copy worker stdout and stderr to ours as it comes, each line prefixed like
    Horovod (``[rank]<stdout>:`` / ``[rank]<stderr>:``) unless prefix is False; with
    ``timestamp`` each line starts with the local time, as Horovod writes it. With
    ``output_dir`` each worker's output also goes, as it is, to
    ``output_dir/rank.<rank>/stdout`` and ``stderr`` (rank zero-padded to the width
    of ``ranks - 1``, like Horovod's --output-filename).

    Lines are forwarded whole, as soon as they end. A progress bar is forwarded as it
    is drawn: tqdm redraws its line after a carriage return, so what follows a carriage
    return goes out at once, and each such segment gets its own prefix. A bar left
    unfinished when another source writes a line on the same stream is ended with a
    newline first; its next redraw gets a prefix again."""

    _SEGMENTS = re.compile(rb"(?<=\n)|(?<=\r)(?!\n)")  # split after \n, or \r not before \n

    def __init__(self, stream: IO[bytes], prefix: bool = True,
                 err_stream: Optional[IO[bytes]] = None, timestamp: bool = False,
                 output_dir: Optional[str] = None, ranks: int = 1) -> None:
        self._streams = {"stdout": stream, "stderr": err_stream or sys.stderr.buffer}
        self._prefix = prefix
        self._timestamp = timestamp
        self._output_dir = output_dir
        self._width = len(str(max(0, ranks - 1)))
        self._opened: set = set()  # files written by this job: later workers append
        self._lock = threading.Lock()
        self._broken = False
        # Per output stream: the source ((rank, kind), or "launcher") whose line is
        # unfinished there; per source: the last byte forwarded (b"" before any, or after
        # its line was ended for another source's output).
        self._open: Dict[str, object] = {}
        self._last: Dict[object, bytes] = {}
        self._pending: Dict[object, bytes] = {}  # per source: its line still being written

    def pump(self, rank: int, proc: "subprocess.Popen[bytes]") -> None:
        """Thread body: forward the worker's stdout and stderr until both end."""
        err = threading.Thread(target=self._pump_one, args=(rank, proc.stderr, "stderr"),
                               daemon=True)
        err.start()
        self._pump_one(rank, proc.stdout, "stdout")
        err.join()

    def _open_copy(self, rank: int, kind: str) -> Optional[IO[bytes]]:
        if not self._output_dir:
            return None
        folder = os.path.join(self._output_dir, f"rank.{rank:0{self._width}d}")
        path = os.path.join(folder, kind)
        with self._lock:
            mode = "ab" if path in self._opened else "wb"
            self._opened.add(path)
        try:
            os.makedirs(folder, exist_ok=True)
            return open(path, mode)  # pylint: disable=consider-using-with
        except OSError as exc:
            log(f"cannot write worker output to {path}: {exc.strerror}")
            return None

    def _pump_one(self, rank: int, pipe: Optional[IO[bytes]], kind: str) -> None:
        if pipe is None:
            return
        tag = f"[{rank}]<{kind}>:".encode() if self._prefix else b""
        copy = self._open_copy(rank, kind)
        # One per pipe: under elastic horovodrun a replacement worker may carry the
        # label (rank) of one that still runs, and their partial lines must not mix.
        source = (rank, kind, id(pipe))
        try:
            with pipe:
                while True:
                    try:
                        data = pipe.read1(65536)  # what is there now, a partial line too
                    except (OSError, ValueError):
                        break
                    if not data:
                        break
                    if copy is not None:
                        copy.write(data)
                        copy.flush()
                    self._forward(source, kind, data, tag)
            # The last line, unfinished: ended with a newline when prefixed.
            end = b"\n" if self._prefix or self._timestamp else b""
            self._forward(source, kind, b"", tag, final=end)
        finally:
            with self._lock:
                self._last.pop(source, None)
                self._pending.pop(source, None)
                if self._open.get(kind) == source:
                    self._open[kind] = None
            if copy is not None:
                copy.close()

    def _forward(self, source, kind: str, data: bytes, tag: bytes,
                 final: Optional[bytes] = None) -> None:
        """Forwards what of `data` (after the source's pending bytes) is ready: whole
        lines, and a bar's segment after a carriage return. `final`: the source's
        output ended; what is pending goes too, followed by `final` unless the last
        byte forwarded ended a line."""
        with self._lock:
            data = self._pending.pop(source, b"") + data
            out = bytearray()
            for piece in self._SEGMENTS.split(data):
                if not piece:
                    continue
                last = self._last.get(source, b"")
                ended = piece.endswith((b"\n", b"\r"))
                if not ended and last in (b"", b"\n") and final is None:
                    self._pending[source] = piece  # a line being written: wait for its end
                    break
                starts = last in (b"", b"\n", b"\r") and not (last == b"\r" and
                                                               piece.startswith(b"\n"))
                if starts and piece != b"\r" and (self._prefix or self._timestamp):
                    out += (time.asctime().encode() + (tag or b" ") if self._timestamp
                            else tag)
                out += piece
                self._last[source] = piece[-1:]
            if final and self._last.get(source, b"") not in (b"", b"\n"):
                out += final
                self._last[source] = final[-1:]
            if out:
                self._emit(source, kind, bytes(out))

    def write_line(self, kind: str, line: str) -> None:
        """Writes a line of the launcher's own to our stdout or stderr, whole,
        between the workers' lines."""
        with self._lock:
            self._emit("launcher", kind, line.encode() + b"\n")

    def _emit(self, source, kind: str, data: bytes) -> None:
        """Writes `data` of `source` (the lock held), first ending another source's
        unfinished line on that stream."""
        if self._broken:  # keep draining so workers never block
            return
        holder = self._open.get(kind)
        if holder is not None and holder != source:
            data = b"\n" + data
            if holder in self._last:
                self._last[holder] = b""  # its next output starts a new, prefixed line
        self._open[kind] = None if data.endswith(b"\n") else source
        try:
            self._streams[kind].write(data)
            self._streams[kind].flush()
        except (OSError, ValueError):
            self._broken = True
