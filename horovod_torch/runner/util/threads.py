"""Background threads, as Horovod's ``horovod.runner.util.threads`` offers them."""
import threading
from typing import Any, Callable, Optional, Tuple


def _check_args(args: Any) -> None:
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args).__name__} "
                         "(for a single argument use (arg,))")


def in_thread(target: Callable[..., Any], args: Tuple[Any, ...] = (),
              name: Optional[str] = None, daemon: bool = True,
              silent: bool = False) -> threading.Thread:
    """Start ``target(*args)`` in a new thread and return the thread.

    ``daemon`` (default True): the thread does not keep the process alive.
    ``silent``: an exception of ``target`` ends the thread quietly instead of being
    reported by ``threading.excepthook``. ``args`` must be a tuple (ValueError).
    """
    _check_args(args)
    body = target
    if silent:
        def body(*call_args: Any) -> None:
            try:
                target(*call_args)
            except BaseException:  # pylint: disable=broad-except
                pass
    thread = threading.Thread(target=body, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def on_event(event: threading.Event, func: Callable[..., Any], args: Tuple[Any, ...] = (),
             stop: Optional[threading.Event] = None, check_stop_interval_s: float = 1.0,
             daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Call ``func(*args)`` in a new thread once ``event`` is set, unless ``stop`` is set
    first (checked every ``check_stop_interval_s``). A non-daemon thread needs
    ``stop``, or it could keep the process alive forever. Returns the thread."""
    if event is None:
        raise ValueError("event must not be None")
    _check_args(args)
    if stop is None and not daemon:
        raise ValueError("a non-daemon event thread needs a stop event")

    def wait_then_call() -> None:
        if stop is None:
            event.wait()
        else:
            while not event.is_set() and not stop.is_set():
                event.wait(timeout=check_stop_interval_s)
            if stop.is_set():
                return
        func(*args)

    return in_thread(wait_then_call, daemon=daemon, silent=silent)
