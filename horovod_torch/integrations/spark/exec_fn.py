"""One rank of ``horovod_torch.spark.run``: ``python -m horovod_torch.spark.exec_fn``,
started by the rank's Spark task (:mod:`horovod_torch.spark.task`) in a session of its
own.

Its stdin is a pipe from the task's Python worker, which never writes to it: when
the pipe closes, that worker is gone (Spark killed the task, or the executor died), and
this process ends its whole process group at once, so no rank outlives its task.
The function itself then runs exactly as under ``horovod.runner.run``
(:mod:`horovod_torch.runner.run_task`): it reads ``(fn, args, kwargs)`` from the
driver's store, calls it, and stores the value under its rank, or the exception and
its traceback (exit code 1). The function sees ``/dev/null`` as stdin.
"""
import os
import signal
import sys
import threading


def _watch_parent(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    except OSError:
        os._exit(1)  # pylint: disable=protected-access


def main() -> int:
    watch_fd = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    threading.Thread(target=_watch_parent, args=(watch_fd,), name="hvd-spark-parent",
                     daemon=True).start()
    from horovod_torch.runner import run_task  # pylint: disable=import-outside-toplevel
    return run_task.main()


if __name__ == "__main__":
    sys.exit(main())
