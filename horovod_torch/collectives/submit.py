"""How Python hands ops to the engine and waits for them: the names of unnamed ops,
the reduction op codes, submit, wait, poll, synchronize, and the handle of a grouped op.
The collectives (ops.py) and process sets (process_sets.py) are built on it."""
import itertools
import threading
import warnings
from typing import Dict, List, Optional

import torch

from horovod_torch import _C
from horovod_torch.engine.basics import Average, Sum, raise_for_status
from horovod_torch.common.handle import Handle

_name_lock = threading.Lock()
_counters: Dict[tuple, "itertools.count"] = {}



def _thread_tag() -> str:
    """"" for the main thread and threads Python did not start (autograd's, for one:
    which of them runs a backward differs between ranks); else the thread's name,
    ".<name>". Threads a script starts are named in the order it starts them
    ("Thread-3 (work)"), the same on every rank."""
    t = threading.current_thread()
    if t is threading.main_thread() or isinstance(t, threading._DummyThread):  # noqa: SLF001
        return ""
    return "." + t.name


def _auto_name(kind: str, name: Optional[str], psid: int = 0) -> str:
    """The name of an op submitted without one: kind and a count, as Horovod names it.
    Ranks outside a set do not count its ops (one counter per set), and a thread the
    script started counts its own ops under its own name: two threads submitting
    unnamed ops at once would otherwise pair rank 0's op of one thread with rank 1's
    of the other, a silently wrong result. A thread started in a different order on
    some rank gets other names there: its ops then wait, and the stall report names
    them."""
    if name is not None:
        return name
    tag = _thread_tag()
    with _name_lock:
        counter = _counters.setdefault((kind, psid, tag), itertools.count())
        n = next(counter)
    base = kind if psid == 0 else f"{kind}.ps{psid}"
    return f"{base}.noname{tag}.{n}"


def reset_auto_names() -> None:
    with _name_lock:
        _counters.clear()


_OPS = {value: name for name, value in _C.REDUCE_OPS.items()}  # every op the core knows


def _resolve_op(op: Optional[int], average: Optional[bool]) -> int:
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        if op is not None:
            raise ValueError("op and average cannot both be given")
        return Average if average else Sum
    if op is None:
        return Average
    if isinstance(op, bool) or op not in _OPS:
        raise ValueError(f"op={op!r} is not a reduction op; use one of "
                         + ", ".join(f"hvd.{n}" for n in _OPS.values()))
    return op


def _submit(kind: int, inputs: List[torch.Tensor], outputs: List[Optional[torch.Tensor]],
            names: List[str], op: int = Sum, root: int = 0, prescale: float = 1.0,
            postscale: float = 1.0, splits: Optional[List[int]] = None,
            grouped: bool = False, psid: int = 0) -> List[int]:
    code, message, handles = _C.submit(kind, inputs, outputs, names, int(op), int(root),
                                       float(prescale), float(postscale),
                                       list(splits or []), grouped, psid)
    raise_for_status(code, message)
    return handles  # the core keeps the tensors alive until the op completes


def _submit_control(kind: int, name: str, ranks: Optional[List[int]] = None,
                    remove_id: int = 0, join_device: int = -1, psid: int = 0) -> int:
    """Submits one control op (_C.CONTROL_*): a barrier, a join, or adding (`ranks`)
    or removing (`remove_id`) a process set. Returns its handle."""
    code, message, handle = _C.submit_control(int(kind), name, list(ranks or []), int(remove_id),
                                              int(join_device), int(psid))
    raise_for_status(code, message)
    return handle


def _contig(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise ValueError("collectives take dense tensors; for a sparse tensor use "
                         "hvd.sparse_allreduce_async(tensor, name=..., op=...) "
                         "(DistributedOptimizer does this for sparse gradients)")
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def poll(handle) -> bool:
    """True if the op behind `handle` has finished (synchronize() will not block)."""
    if isinstance(handle, Handle):
        return handle.poll()
    done = _C.poll(handle)
    if done is None:
        raise ValueError(f"unknown handle {handle}: it was already synchronized or never existed")
    return done


def _wait(handle: int):
    result = _C.wait(handle)
    if result is None:
        raise ValueError(f"unknown handle {handle}: it was already synchronized or never existed")
    code, message, output, splits = result
    raise_for_status(code, message)
    return output, splits


def _wait_many(handles: list) -> List[torch.Tensor]:
    """The outputs of many async ops (not alltoall), as one wait: the core releases
    the GIL once and makes the caller's stream wait once per fused batch."""
    if any(isinstance(h, Handle) for h in handles):
        return [synchronize(h) for h in handles]
    outs = []
    for h, result in zip(handles, _C.wait_many(list(handles))):
        if result is None:
            raise ValueError(f"unknown handle {h}: it was already synchronized or never existed")
        code, message, output, _ = result
        raise_for_status(code, message)
        outs.append(output)
    return outs


def synchronize(handle):
    """Waits for an async op; returns its output (alltoall: (output, received_splits))."""
    if isinstance(handle, Handle):
        return handle.synchronize()
    output, splits = _wait(handle)
    if splits is not None:
        return output, splits
    return output


def _group_names(kind: str, name: Optional[str], n: int, psid: int = 0) -> List[str]:
    base = _auto_name(kind, name, psid)
    return [f"{base}.{i}" for i in range(n)]


class GroupHandle(Handle):
    """The one handle of a grouped op (as in Horovod): ``hvd.synchronize(handle)``
    returns the list of outputs and ``hvd.poll(handle)`` is True when all are done.
    It also iterates over the per-tensor handles."""

    def __init__(self, handles):
        self.handles = list(handles)

    def poll(self) -> bool:
        return all(poll(h) for h in self.handles)

    def synchronize(self) -> list:
        # Every member is waited for (and its name freed) before an error is raised.
        return _wait_many(self.handles)

    def __iter__(self):
        return iter(self.handles)

    def __len__(self) -> int:
        return len(self.handles)

    def __getitem__(self, i):
        return self.handles[i]
