"""Values sent from the workers to the driver's callbacks (Horovod's
``horovod.ray.ray_logger``): ``ray_logger.log({...})`` in a worker; every callable in
``executor.run(fn, callbacks=[...])`` is called with each value on the driver.

The executor configures the queue only when it was given callbacks; without it
``log`` warns once and drops the value.
"""
import warnings

_queue = None
_warned = False


def configure(queue) -> None:
    global _queue
    _queue = queue


def log(info_dict) -> None:
    """Sends ``info_dict`` (anything picklable) to the driver's callbacks."""
    global _warned
    if _queue is not None:
        _queue.put(info_dict)
    elif not _warned:
        warnings.warn("`ray_logger.log` called but logging is not configured "
                      "(pass callbacks=[...] to the executor's run)")
        _warned = True
