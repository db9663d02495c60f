"""Parts of sharded optimizer state, for elastic commits and recovery.

A part is one rank's optimizer state as one flat host buffer per dtype (``pack``,
``unpack``). This module offers the parts to their keepers (``keepers``,
``send_parts``), gathers what every rank offers after a membership change
(``gather_offers``, ``missing``) and re-shards it for the new world (``reshard``).
Used by ``ShardedStateMixin._part`` (horovod_torch/training/sharded.py) and by
``ShardedOptimizerStateHandler`` in elastic/handlers.py.
"""
import copy
from typing import Any, Dict, List, Optional, Tuple

import torch

from horovod_torch.collectives.process_sets import _ps_id, _set_rank, _set_size


def _to_cpu(value: Any) -> Any:
    """A copy of nested optimizer state with every tensor on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return copy.deepcopy(value)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def pack(state: Dict[int, Dict[str, Any]], device: torch.device) -> Dict[str, Any]:
    """A rank's optimizer state ({parameter index: {key: value}}) as a part: the
    tensors on the parameters' device concatenated into one flat host tensor per
    dtype (``flats``; pinned, copied asynchronously, when on a GPU), where ``meta``
    lists (index, key, dtype, shape, offset); everything else in ``values``."""
    meta, values, chunks, sizes = [], {}, {}, {}
    for idx in sorted(state):
        for key, v in state[idx].items():
            if isinstance(v, torch.Tensor) and v.device == device and v.numel() > 0:
                name = _dtype_name(v.dtype)
                off = sizes.get(name, 0)
                meta.append((int(idx), key, name, tuple(v.shape), off))
                chunks.setdefault(name, []).append(v.detach().reshape(-1))
                sizes[name] = off + v.numel()
            else:
                values.setdefault(int(idx), {})[key] = _to_cpu(v)
    flats = {}
    for name, tensors in chunks.items():  # copied tensor by tensor: no device-side copy
        host = _host_empty(sizes[name], tensors[0].dtype, device)
        off = 0
        for t in tensors:
            host[off:off + t.numel()].copy_(t, non_blocking=True)
            off += t.numel()
        flats[name] = host
    _host_copies_done(device)
    return {"meta": meta, "values": values, "flats": flats}


def _host_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t  # already this process's own tensor
    host = _host_empty(t.numel(), t.dtype, t.device).view(t.shape)
    host.copy_(t, non_blocking=True)
    return host


def _host_copies_done(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def unpack(part: Dict[str, Any], device: torch.device, flats=None) -> Dict[int, Dict[str, Any]]:
    """The state a part holds, its tensors on ``device`` (views of one buffer per
    dtype; ``flats`` overrides the part's own)."""
    flats = part["flats"] if flats is None else flats
    on_device = {n: f.to(device, non_blocking=True) for n, f in flats.items()}
    state: Dict[int, Dict[str, Any]] = {}
    for idx, key, name, shape, off in part["meta"]:
        state.setdefault(idx, {})[key] = on_device[name][off:off + _numel(shape)].view(shape)
    for idx, vals in part["values"].items():
        state.setdefault(idx, {}).update(copy.deepcopy(vals))
    return state


def summary(part: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """A part without its buffers (what the others need to know about it)."""
    if part is None:
        return None
    out = {k: v for k, v in part.items() if k != "flats"}
    out["sizes"] = {n: f.numel() for n, f in part["flats"].items()}
    return out


def keepers(hosts: List[Any]) -> List[int]:
    """The rank that keeps a copy of each rank's part, given each rank's host: the
    rank with the same place among its host's ranks on the next host (cycling through
    that host's ranks when it has fewer), so that losing any one host loses no part
    and the copies spread evenly; on a single host, the next rank."""
    n = len(hosts)
    order: Dict[Any, List[int]] = {}
    for r, h in enumerate(hosts):
        order.setdefault(h, []).append(r)
    groups = list(order.values())
    if len(groups) == 1:
        return [(r + 1) % n for r in range(n)]
    keeper = [0] * n
    for g, ranks in enumerate(groups):
        nxt = groups[(g + 1) % len(groups)]
        for i, r in enumerate(ranks):
            keeper[r] = nxt[i % len(nxt)]
    return keeper


def send_parts(part: Optional[Dict[str, Any]], key: Any, targets_of, device: torch.device,
               process_set) -> List[Dict[str, Any]]:
    """Collective: every rank offers ``part`` (or None) and ``key``; ``targets_of``
    (the keys of every rank) gives the rank each rank's part goes to (None: nowhere).
    Returns the parts sent to this rank (their buffers in host memory), in sending
    rank order. One small allgather (the parts' summaries and keys), then one alltoall
    per dtype, from the device (NCCL on GPUs)."""
    from horovod_torch.training.functions import allgather_object
    from horovod_torch.collectives.ops import alltoall
    n, r = _set_size(_ps_id(process_set)), _set_rank(_ps_id(process_set))
    if n == 1:
        return []
    infos = allgather_object((summary(part), key), name="sharded.parts_meta",
                             process_set=process_set)
    targets = targets_of([k for _, k in infos])
    senders = [s for s in range(n) if infos[s][0] is not None and targets[s] == r]
    if part is None or targets[r] is None or targets[r] == r:
        part = None  # nothing of this rank travels
    names = sorted({name for info, _ in infos if info is not None for name in info["sizes"]})
    received: Dict[str, torch.Tensor] = {}
    for name in names:
        mine = part["flats"].get(name) if part is not None else None
        send = (mine.to(device, non_blocking=True) if mine is not None
                else torch.empty(0, dtype=getattr(torch, name), device=device))
        splits = [0] * n
        if mine is not None:
            splits[targets[r]] = send.numel()
        out, _ = alltoall(send, splits=splits, name=f"sharded.parts.{name}",
                          process_set=process_set)
        received[name] = _to_host(out)
    _host_copies_done(device)
    parts, offsets = [], dict.fromkeys(names, 0)
    for s in senders:
        if s == r:
            continue
        info = infos[s][0]
        flats = {}
        for name, size in info["sizes"].items():
            flats[name] = received[name][offsets[name]:offsets[name] + size]
            offsets[name] += size
        parts.append(dict(info, flats=flats))
    return parts


def gather_offers(offers: List[Dict[str, Any]], process_set) -> List[List[Dict[str, Any]]]:
    """Collective: every rank's offered parts (their summaries), by rank."""
    from horovod_torch.training.functions import allgather_object
    return allgather_object([summary(p) for p in offers], name="sharded.offers",
                            process_set=process_set)


def _sources(infos: List[List[Dict[str, Any]]], seq: int) -> Dict[int, Tuple[int, int]]:
    """For each parameter index, the (rank, offer) holding its part of commit ``seq``:
    offers in the order offered (a rank's own part first), the lowest rank first."""
    source: Dict[int, Tuple[int, int]] = {}
    for j in range(max((len(o) for o in infos), default=0)):
        for rank, offered in enumerate(infos):
            if j < len(offered) and offered[j]["seq"] == seq:
                for idx in offered[j]["owned"]:
                    source.setdefault(idx, (rank, j))
    return source


def missing(infos: List[List[Dict[str, Any]]], seq: int, count: int) -> List[int]:
    """The indices of ``count`` parameters whose part of commit ``seq`` nobody offers
    (none before the first commit, seq 0: the initial state has no state to lose)."""
    if seq == 0:
        return []
    source = _sources(infos, seq)
    return [i for i in range(count) if i not in source]


def reshard(offers: List[Dict[str, Any]], infos: List[List[Dict[str, Any]]], seq: int,
            shard: "Shard", device: torch.device, process_set):  # noqa: F821 (sharded.Shard)
    """Collective, after an elastic reset: every rank has offered its parts (``offers``,
    summarised by rank in ``infos``); for each parameter one holder of commit ``seq``
    is chosen (see _sources), and one alltoall per dtype sends each parameter's state
    from that holder to its owner under ``shard`` (the new partition). Returns (state
    for this rank, the param groups of commit ``seq``)."""
    from horovod_torch.collectives.ops import alltoall
    n, r = shard.size, shard.rank
    source = _sources(infos, seq)
    owner = shard.owner
    mine = {idx: src for idx, src in source.items() if owner[idx] == r}
    names = sorted({name for offered in infos for info in offered if info["seq"] == seq
                    for name in info["sizes"]})
    state: Dict[int, Dict[str, Any]] = {}
    for name in names:
        # what this rank sends, destination by destination, parameter by parameter
        pieces, splits = [], [0] * n
        for dest in range(n):
            for idx in sorted(i for i, src in source.items() if src[0] == r and owner[i] == dest):
                part = offers[source[idx][1]]
                for i, key, nm, shape, off in part["meta"]:
                    if i == idx and nm == name:
                        numel = _numel(shape)
                        pieces.append(part["flats"][name][off:off + numel])
                        splits[dest] += numel
        dtype = getattr(torch, name)
        send = torch.cat(pieces).to(device) if pieces else torch.empty(0, dtype=dtype,
                                                                       device=device)
        received, _ = alltoall(send, splits=splits, name=f"sharded.reshard.{name}",
                               process_set=process_set)
        pos = 0
        for src_rank in range(n):
            for idx in sorted(i for i, src in mine.items() if src[0] == src_rank):
                info = infos[src_rank][mine[idx][1]]
                for i, key, nm, shape, off in info["meta"]:
                    if i == idx and nm == name:
                        numel = _numel(shape)
                        state.setdefault(idx, {})[key] = received[pos:pos + numel].view(shape)
                        pos += numel
    for idx, (src_rank, j) in mine.items():
        vals = infos[src_rank][j]["values"].get(idx)
        if vals:
            state.setdefault(idx, {}).update(vals)
    groups = next(info["param_groups"] for offered in infos for info in offered
                  if info["seq"] == seq)
    return state, groups


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
