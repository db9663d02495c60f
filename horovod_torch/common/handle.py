"""Handles of async ops made in Python. The engine's own handles are ints (its handle
table's keys, as in Horovod); every other handle is a :class:`Handle`, and
``hvd.poll`` / ``hvd.synchronize`` tell the two apart by that type alone."""


class Handle:
    """An async op's handle: ``poll()`` tells whether ``synchronize()`` would block;
    ``synchronize()`` waits and returns the result."""

    def poll(self) -> bool:
        raise NotImplementedError

    def synchronize(self):
        raise NotImplementedError


class DoneHandle(Handle):
    """An op already computed at submission (Adasum): its result, given once, as an
    engine handle's is."""

    def __init__(self, output):
        self._output = output

    def _check(self) -> None:
        if self._output is None:
            raise ValueError(f"unknown handle {self!r}: it was already synchronized")

    def poll(self) -> bool:
        self._check()
        return True

    def synchronize(self):
        self._check()
        output, self._output = self._output, None
        return output
