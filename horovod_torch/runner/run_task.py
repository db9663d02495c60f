"""Worker side of ``horovod.runner.run`` (``python -m horovod_torch.runner.run_task``):
read the function from the caller's store, call it, store its value under this
worker's rank, or its exception and traceback (then exit 1, which stops the job).
"""
import os
import pickle
import sys
import traceback

from horovod_torch.runner import func as run_func


def _rank() -> int:
    """hvd.rank() if the function left horovod initialised, else the rank this worker
    was started as."""
    basics = sys.modules.get("horovod_torch.engine.basics")
    if basics is not None:
        try:
            if basics.is_initialized():
                return int(basics.rank())
        except Exception:  # pylint: disable=broad-except
            pass
    return int(os.environ.get("HOROVOD_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)


def main() -> int:
    store = run_func._worker_store()  # pylint: disable=protected-access
    payload = store.get(run_func.KEY_FUNC, 30.0)
    if payload is None:
        sys.stderr.write("horovod.runner.run: the function to run was not found in the "
                         "caller's store\n")
        return 1
    func, args, kwargs = pickle.loads(payload)
    try:
        value = func(*args, **kwargs)
    except Exception as exc:  # pylint: disable=broad-except
        text = traceback.format_exc()
        sys.stderr.write(f"User function raise error: {exc}\n{text}")
        sys.stderr.flush()
        try:
            pickled = run_func.dumps(exc)
            pickle.loads(pickled)
        except Exception:  # pylint: disable=broad-except
            pickled = None
        error = {"rank": _rank(), "traceback": text, "exception": pickled,
                 "summary": f"{type(exc).__name__}: {exc}"}
        seq = store.add(run_func.KEY_ERRORS, 1)
        store.set(run_func.KEY_ERROR.format(seq=seq), pickle.dumps(error))
        return 1
    store.set(run_func.KEY_RESULT.format(rank=_rank()), run_func.dumps(value))
    return 0


if __name__ == "__main__":
    sys.exit(main())
