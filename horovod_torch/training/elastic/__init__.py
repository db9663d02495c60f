"""Elastic training: ``@hvd.elastic.run`` retries the training function across
failures and host changes, with state kept in ``hvd.elastic.TorchState``."""
import functools
import sys
from typing import Callable

from horovod_torch.engine import basics
from horovod_torch.engine.basics import init, shutdown  # noqa: F401  (Horovod's module has them)
from horovod_torch.training.elastic.sampler import ElasticSampler
from horovod_torch.training.elastic.state import ObjectState, State, TorchState
from horovod_torch.common import elastic_worker as worker
from horovod_torch.common.elastic_worker import notification_manager
from horovod_torch.common.exceptions import (CommittedStateLostError, HorovodInternalError,
                                             HostsUpdatedInterrupt)

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler",
           "CommittedStateLostError"]


def _reset() -> None:
    basics.shutdown()
    basics.init()


def run_fn(func: Callable, reset: Callable[[], None]) -> Callable:
    """Wraps ``func(state, ...)`` so it runs until it returns, calling `reset()` to
    re-form the job after a failure or a host change (``run`` is
    ``run_fn(func, shutdown-then-init)``).

    On HorovodInternalError (a peer died) the last committed state is restored; on
    HostsUpdatedInterrupt it is kept. Either way the job re-forms against the new set
    of workers, the state's reset callbacks run, and the state of the lowest rank
    holding the newest commit is broadcast (skipped when hosts were only removed).
    CommittedStateLostError from that sync (no worker left holds the newest commit)
    is not caught: the job ends. The launcher's --reset-limit bounds the number of
    resets (the driver stops the job rather than form one generation too many).
    """
    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        reset_required = False
        skip_sync = False
        notification_manager.init()
        notification_manager.register_listener(state)
        try:
            while True:
                try:
                    if reset_required:
                        reset()
                        state.on_reset()
                    if not skip_sync or state.must_sync_after_reset():
                        state.sync()
                    return func(state, *args, **kwargs)
                except HorovodInternalError as e:
                    print(f"horovod_torch: rank {_safe_rank()} lost a peer ({e}); restoring "
                          f"{state.describe_commit()} and re-forming the job",
                          file=sys.stderr, flush=True)
                    worker.report_leaving(str(e))
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as e:
                    worker.report_leaving(None)
                    skip_sync = e.skip_sync
                reset_required = True
        finally:
            notification_manager.remove_listener(state)
    return wrapper


def run(func):
    """Decorator: ``func(state, ...)`` runs until it returns, across failures and host
    changes (see run_fn). The first argument must be the ``State`` (e.g. a TorchState).
    Do not call collectives outside it that a joining worker would not call."""
    return run_fn(func, _reset)


def _safe_rank():
    try:
        return basics.rank()
    except ValueError:
        return "?"
