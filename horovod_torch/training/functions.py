"""Helpers built from the collectives: objects, parameters and optimizer state."""
import io
import pickle
from typing import Any, List, Optional

import torch

from horovod_torch.engine.basics import rank
from horovod_torch.collectives.ops import allgather, broadcast_, broadcast_async_
from horovod_torch.collectives.process_sets import _ps_id, global_process_set
from horovod_torch.collectives.submit import synchronize


def _to_bytes_tensor(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_bytes_tensor(t: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=False)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set=global_process_set) -> Any:
    """Returns root_rank's `obj` on every rank (any picklable object)."""
    name = name or type(obj).__name__
    _ps_id(process_set)  # a registered set this rank belongs to
    is_root = rank() == root_rank  # a global rank, as in Horovod
    payload = _to_bytes_tensor(obj) if is_root else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    broadcast_(length, root_rank, name=f"broadcast_object.{name}.len", process_set=process_set)
    if not is_root:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank, name=f"broadcast_object.{name}.data",
               process_set=process_set)
    return obj if is_root else _from_bytes_tensor(payload)


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set=global_process_set) -> List[Any]:
    """Returns the list of every rank's `obj`, in rank order."""
    name = name or type(obj).__name__
    payload = _to_bytes_tensor(obj)
    lengths = allgather(torch.tensor([payload.numel()], dtype=torch.int64),
                        name=f"allgather_object.{name}.len", process_set=process_set)
    data = allgather(payload, name=f"allgather_object.{name}.data", process_set=process_set)
    out, offset = [], 0
    for n in lengths.tolist():
        out.append(_from_bytes_tensor(data[offset:offset + n]))
        offset += n
    return out


def broadcast_parameters(params, root_rank: int = 0, process_set=global_process_set) -> None:
    """Overwrites parameters in place with root_rank's values.

    `params` is a ``model.state_dict()``, ``model.named_parameters()`` or a list of
    (name, tensor) pairs.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = list(params)
        if all(isinstance(p, torch.Tensor) for p in items):  # model.parameters()
            items = [(f"param.{i}", p) for i, p in enumerate(items)]
        elif not all(isinstance(p, tuple) and len(p) == 2 for p in items):
            raise ValueError("broadcast_parameters expects a state_dict, (name, tensor) pairs "
                             "or a list of tensors")
    handles = []
    for name, p in items:
        if p is None:
            continue
        t = p.data if isinstance(p, torch.nn.Parameter) else p
        if not t.is_contiguous():
            raise ValueError(f"parameter '{name}' is not contiguous; cannot broadcast in place")
        handles.append(broadcast_async_(t, root_rank, name=f"broadcast_parameters.{name}",
                                        process_set=process_set))
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: Optional[torch.nn.Module] = None,
                              process_set=global_process_set) -> None:
    """Makes every rank's optimizer state (hyper-parameters and per-parameter state,
    initialised or not) equal to root_rank's. `model` is accepted for Horovod's
    signature (it named sparse parameters there); the state is sent whole here.

    As in Horovod, an optimizer without state leaves every parameter that needs a
    gradient with a zero one where it had none."""
    if hasattr(optimizer, "_broadcast_state"):  # sharded (shard_optimizer_state)
        optimizer._broadcast_state(root_rank)
        return
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    is_root = rank() == root_rank
    state = optimizer.state_dict() if is_root else None
    state = broadcast_object(state, root_rank, name="optimizer_state", process_set=process_set)
    if not is_root:
        optimizer.load_state_dict(state)
