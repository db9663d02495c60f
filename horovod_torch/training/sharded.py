"""Sharded optimizer state: ``DistributedOptimizer(..., shard_optimizer_state=True)``.

Each rank of the process set owns about 1/N of the parameters, balanced by size
(``partition``), and keeps optimizer state only for those. The gradients are averaged
as in the unsharded optimizer (the same hooks, fusion, compression and
backward_passes_per_step), every rank steps the user's own optimizer on the
parameters it owns (the others' gradients are hidden from it, so it creates no state
for them), and one grouped allgather then brings every rank the updated parameters
of the others. Stage 2 (``shard_optimizer_state=2``) also frees, in step(), the
gradients of parameters a rank does not own. Until then every rank holds every
reduced gradient, so GradScaler's overflow check, gradient clipping and synchronize()
see what they see unsharded, and every rank takes the same decision.

The math is the unsharded optimizer's, parameter by parameter: any per-parameter
torch.optim optimizer gives the same parameters as unsharded training (bitwise:
same reductions, same update code). With ``reduce_scatter_gradients=True`` each
gradient is instead reduced to its owner only (a reduce-scatter; a rank keeps its own
parameters' gradients, the others' are None after synchronize()): GradScaler is kept
in step by making a non-finite gradient on any rank visible on every rank,
``clip_grad_norm_`` combines the ranks' norms, and the result matches unsharded
training within float rounding (the sums run in another order).

``ShardedStateMixin`` holds the methods that replace or extend
``_DistributedOptimizer``'s; the elastic handler that keeps a replica of each shard is
``ShardedOptimizerStateHandler`` in elastic/handlers.py, and the parts it copies and
re-shards are built and moved by sharded_recovery.py.
"""
import copy
import hashlib
from typing import Any, Dict, List, Optional

import torch

from horovod_torch.engine import basics
from horovod_torch.engine.basics import Max, Sum
from horovod_torch.collectives.ops import (allreduce_async, grouped_allgather_async,
                                           reducescatter_async)
from horovod_torch.collectives.process_sets import _ps_id, _set_rank, _set_size
from horovod_torch.collectives.submit import synchronize
from horovod_torch.training.functions import allgather_object, broadcast_object
from horovod_torch.training.sharded_recovery import _to_cpu, pack


def partition(sizes: List[int], n: int) -> List[int]:
    """The owner rank of each parameter: largest first, each to the least loaded
    rank (the lowest on ties). Deterministic, so every rank computes the same."""
    load = [0] * n
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def order_digest(params: List[torch.Tensor], names: List[str]) -> int:
    """A 63-bit digest of the parameters' order (names, shapes, dtypes): equal on
    every rank when they list the same parameters in the same order."""
    h = hashlib.sha256()
    for p, name in zip(params, names):
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|{p.requires_grad}\n".encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1


_ORDER_DIFFERS = (
    "the ranks list this optimizer's parameters in different orders (ranks {ranks} differ "
    "from rank 0): sharded optimizer state is partitioned by that order, so their "
    "parameters would be exchanged into one another. Build the param groups in the same "
    "order on every rank: for example from sorted(names), not from a set, whose order "
    "differs between processes (each has its own PYTHONHASHSEED)")


class Shard:
    """Who owns what among ``params`` (the optimizer's parameters in state_dict
    order, called ``names``) on a process set of ``size`` ranks, seen from ``rank``."""

    def __init__(self, params: List[torch.Tensor], size: int, rank: int, names: List[str]):
        self.params, self.size, self.rank = params, size, rank
        self.owner = partition([p.numel() if p.requires_grad else 0 for p in params], size)
        self.owned = [i for i, o in enumerate(self.owner) if o == rank]
        self._owned_set = set(self.owned)
        self.index = {p: i for i, p in enumerate(params)}
        # Every gather carries this order's digest (8 bytes a rank, in the same
        # grouped allgather, so that a rank whose partition is older still matches a
        # newcomer's group); the first gather of each partition compares them.
        self._digest = torch.tensor([order_digest(params, names)], dtype=torch.int64,
                                    device=params[0].device if params else None)
        self._order_checked = False

    def owns(self, index: int) -> bool:
        return index in self._owned_set

    def gather_parameters(self, process_set) -> None:
        """Every rank's owned parameters to every rank: one grouped allgather, one
        flat buffer per dtype (in index order) and the order digest, copied back into
        the parameters."""
        if self.size == 1:
            return
        dtypes = sorted({p.dtype for p in self.params}, key=str)
        device = self.params[0].device
        flats = []
        with torch.no_grad():
            for dt in dtypes:
                mine = [self.params[i].detach().reshape(-1) for i in self.owned
                        if self.params[i].dtype == dt]
                flats.append(torch.cat(mine) if mine else torch.empty(0, dtype=dt, device=device))
            flats.append(self._digest)
            outs = synchronize(grouped_allgather_async(flats, name="sharded.parameters",
                                                       process_set=process_set))
            if not self._order_checked:
                self._check_order(outs[-1])
            dst, src = [], []
            for dt, out in zip(dtypes, outs):
                offset = 0
                for r in range(self.size):
                    for i, p in enumerate(self.params):
                        if self.owner[i] != r or p.dtype != dt:
                            continue
                        n = p.numel()
                        if r != self.rank:
                            dst.append(p.data.view(-1))
                            src.append(out[offset:offset + n])
                        offset += n
            if dst:
                torch._foreach_copy_(dst, src)

    def _check_order(self, digests: torch.Tensor) -> None:
        """Raises ValueError, on every rank alike, if the ranks' orders differ."""
        got = digests.tolist()
        differ = [r for r, d in enumerate(got) if d != got[0]]
        if differ:
            raise ValueError(_ORDER_DIFFERS.format(ranks=differ))
        self._order_checked = True


_NOT_CONSOLIDATED = (
    "this optimizer shards its state over the ranks (shard_optimizer_state), so no "
    "rank holds all of it: call optimizer.consolidate_state_dict(root_rank) on every "
    "rank first, then state_dict() on the root (a dict an unsharded optimizer loads), "
    "or save each rank's part with sharded_state_dict()")


class ShardedOptimizer:
    """A base of every sharded DistributedOptimizer's class (for isinstance; the
    elastic TorchState picks its handler by it). It has no methods of its own."""


class ShardedStateMixin:
    """Methods of a sharded DistributedOptimizer (see DistributedOptimizer): copied
    over _DistributedOptimizer's in the class made for the user's optimizer, so
    ``super(self.__class__, self)`` is the user's optimizer class."""

    # _DistributedOptimizer, whose methods these extend: set in the class
    # DistributedOptimizer makes (optimizer.py imports this module, not the reverse).
    _unsharded: type = None

    def _shard_init(self, stage: int) -> None:
        self._stage = stage
        # (the hooks may have asked for the partition already)
        self._shard_cache: Optional[Shard] = getattr(self, "_shard_cache", None)
        self._consolidated: Optional[Dict[str, Any]] = None
        self._consolidated_root: Optional[int] = None
        self._loaded_full: Optional[Dict[str, Any]] = None
        params = self._all_params()
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError("shard_optimizer_state needs every parameter on one device; "
                             f"this optimizer's are on {sorted(map(str, devices))}")
        bad = [self._parameter_names.get(p, str(i)) for i, p in enumerate(params)
               if not p.is_contiguous()]
        if bad:
            raise ValueError(f"shard_optimizer_state needs contiguous parameters; {bad[:3]} "
                             "are not")

    def _all_params(self) -> List[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _shard(self) -> Optional[Shard]:
        """The current partition (recomputed when the process set's size or this
        rank's place changed, as after an elastic reset); None outside the set."""
        if not self._included:
            return None
        psid = _ps_id(self._process_set)
        size, rank = _set_size(psid), _set_rank(psid)
        s = getattr(self, "_shard_cache", None)
        if s is None or s.size != size or s.rank != rank:
            params = self._all_params()
            s = self._shard_cache = Shard(params, size, rank,
                                          [self._parameter_names.get(p, "") for p in params])
            if self._scatter and self._native is not None:
                # the C++ hooks know each gradient's owner: tell them the new ones
                self._native = None
                self._register_hooks()
        return s

    # -- stepping ------------------------------------------------------------

    def _local_step(self, closure=None):
        """The closure (step() made it reduce the gradients it computes) runs once,
        before the update, like the per-parameter optimizers' own step(closure)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        shard = self._shard()
        if shard is None:  # outside the process set: trains on its own, unsharded
            super(self.__class__, self).step()
            return loss
        hidden = {}
        for i, p in enumerate(shard.params):
            if not shard.owns(i) and p.grad is not None:
                hidden[p] = p.grad
                p.grad = None
        try:
            super(self.__class__, self).step()
        finally:
            if self._stage < 2:
                for p, g in hidden.items():
                    p.grad = g
        shard.gather_parameters(self._process_set)
        self._consolidated = None
        self._loaded_full = None
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over all of the optimizer's parameters. Returns
        the total norm. Every rank holds every reduced gradient until step() (stage 2
        included); with reduce_scatter_gradients a rank holds its own, and the norm is
        combined across the ranks (one small allreduce)."""
        shard = self._shard()
        if not self._scatter or shard is None or shard.size == 1:
            return torch.nn.utils.clip_grad_norm_(self._all_params(), max_norm, norm_type)
        norm_type = float(norm_type)
        grads = [shard.params[i].grad for i in shard.owned if shard.params[i].grad is not None]
        device = shard.params[0].device
        dense = [g for g in grads if not g.is_sparse]
        norms = [n.float() for n in torch._foreach_norm(dense, norm_type)] if dense else []
        norms += [torch.linalg.vector_norm(g.coalesce()._values(), norm_type).float()
                  for g in grads if g.is_sparse]
        local = (torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms
                 else torch.zeros((), device=device, dtype=torch.float32))
        inf = norm_type == float("inf")
        part = local if inf else local.pow(norm_type)
        total = synchronize(allreduce_async(part.reshape(1), name="sharded.grad_norm",
                                            op=Max if inf else Sum,
                                            process_set=self._process_set))[0]
        if not inf:
            total = total.pow(1.0 / norm_type)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch's clip_grad_norm_
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for g in dense:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, group in by_dtype.items():
            torch._foreach_mul_(group, coef.to(dtype))
        for g in grads:
            if g.is_sparse:
                g.mul_(coef.to(g.dtype))
        return total

    # -- reduce-scattered gradients (reduce_scatter_gradients=True) -------------------

    _scatter = False  # set in the class DistributedOptimizer makes

    def _native_targets(self, params):
        shard = self._shard()
        if not self._scatter or shard is None or shard.size == 1:
            return self._unsharded._native_targets(self, params)
        names = ["reducescatter." + self._parameter_names[p] for p in params]
        return names, {"owners": [shard.owner[shard.index[p]] for p in params],
                       "rank": shard.rank, "set_size": shard.size}

    def _start(self, p: torch.Tensor) -> None:
        """With reduce_scatter_gradients: the gradient's reduction goes to its owner only
        (a reduce-scatter whose splits give every row to the owner; the engine fuses
        consecutive ones into one collective). A rank drops the gradients it does not
        own as soon as their reduction is submitted; the engine keeps them until it
        has sent them. Sparse gradients (without sparse_as_dense) are allreduced."""
        shard = self._shard()
        if (not self._scatter or shard is None or shard.size == 1
                or (p.grad is not None and p.grad.is_sparse and not self._sparse_as_dense)):
            return self._unsharded._start(self, p)
        op, pre, post = self._scales()
        compressed, ctx = self._prepare(p)
        owner = shard.owner[shard.index[p]]
        splits = [0] * shard.size
        splits[owner] = compressed.numel()
        h = reducescatter_async(compressed.reshape(-1), name="reducescatter." +
                                self._parameter_names[p], op=op, prescale_factor=pre,
                                postscale_factor=post, process_set=self._process_set,
                                splits=splits)
        self._started(p, (h, ctx, None))
        if owner != shard.rank:
            p.grad = None
        return None

    def _write_reduced(self, dense, outs) -> None:
        shard = self._shard()
        if not self._scatter or shard is None:
            return self._unsharded._write_reduced(self, dense, outs)
        mine = [(d, out) for d, out in zip(dense, outs) if shard.owns(shard.index[d[0]])]
        return self._unsharded._write_reduced(self, [d for d, _ in mine],
                                              [out for _, out in mine])

    def synchronize(self) -> None:
        shard = self._shard()
        scattered = self._scatter and shard is not None and shard.size > 1
        if (scattered and self._synchronized and not self._handles
                and not (self._native is not None and self._native.in_flight())
                and all(p.grad is None for i, p in enumerate(shard.params)
                        if not shard.owns(i))):
            # Reduced already, and no backward pass since (it would have given the
            # others' parameters gradients again): a second reduction, with those
            # absent (zeros), would divide the owned gradients by the set's size.
            return
        self._unsharded.synchronize(self)
        if scattered:
            for i, p in enumerate(shard.params):
                if not shard.owns(i):
                    p.grad = None
            self._agree_on_non_finite(shard)

    def _agree_on_non_finite(self, shard: Shard) -> None:
        """If any rank's gradients hold an inf or NaN, puts a NaN into this rank's
        first owned gradient too, so that GradScaler (or any check of the gradients a
        rank holds) skips the step on every rank alike: one multi-tensor check per
        dtype and one small allreduce, without waiting for the device."""
        values = []  # the owned gradients (a sparse one's values), as GradScaler sees them
        for i in shard.owned:
            g = shard.params[i].grad
            if g is not None and g.is_floating_point():
                v = g._values() if g.is_sparse else g
                if v.numel():
                    values.append(v)
        device = shard.params[0].device
        found = torch.zeros(1, dtype=torch.float32, device=device)
        one = torch.ones(1, dtype=torch.float32, device=device)
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for v in values:
            by_dtype.setdefault(v.dtype, []).append(v)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, one)
        found = synchronize(allreduce_async(found, name="sharded.non_finite", op=Max,
                                            process_set=self._process_set))
        if values:
            first = values[0].view(-1)[:1]
            first.copy_(torch.where(found > 0, torch.full_like(first, float("nan")), first))

    # -- state dicts ---------------------------------------------------------

    def _local_state(self) -> Dict[str, Any]:
        """This rank's part: the user optimizer's state_dict (state of the owned
        parameters only, indexed as in the full dict)."""
        return super(self.__class__, self).state_dict()

    def state_dict(self) -> Dict[str, Any]:
        """The consolidated state (loadable by the unsharded optimizer), available
        on the root of the last consolidate_state_dict() until the next step()."""
        if self._consolidated is None:
            raise RuntimeError(_NOT_CONSOLIDATED)
        return self._consolidated

    def consolidate_state_dict(self, root_rank: Optional[int] = 0) -> None:
        """Collective: gathers every rank's part of the state into one dict (on the
        CPU) that state_dict() then returns on ``root_rank`` (on every rank when
        ``root_rank`` is None). Host memory of the whole state on each rank while
        it runs."""
        shard = self._shard()
        local = self._local_state()
        if shard is None or shard.size == 1:
            self._consolidated = _to_cpu(local)
            return
        parts = allgather_object(_to_cpu(local["state"]), name="sharded.consolidate",
                                 process_set=self._process_set)
        if root_rank is None or basics.rank() == root_rank:
            state = {}
            for part in parts:
                state.update(part)
            self._consolidated = {"state": dict(sorted(state.items())),
                                  "param_groups": copy.deepcopy(local["param_groups"])}
        else:
            self._consolidated = None

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a full (consolidated or unsharded) state dict: this rank keeps the
        state of the parameters it owns. broadcast_optimizer_state() after a load
        on one rank sends the dict to the others."""
        self._reset_pending()
        self._load_full(state_dict)
        self._loaded_full = state_dict

    def _load_full(self, state_dict: Dict[str, Any]) -> None:
        shard = self._shard()
        if shard is None:
            return super(self.__class__, self).load_state_dict(state_dict)
        mine = {k: v for k, v in state_dict["state"].items() if shard.owns(int(k))}
        super(self.__class__, self).load_state_dict(
            {"state": mine, "param_groups": state_dict["param_groups"]})
        self._consolidated = None
        return None

    def sharded_state_dict(self) -> Dict[str, Any]:
        """This rank's part of the state, for a per-rank checkpoint file; load it
        with load_sharded_state_dict() in a job of the same size."""
        shard = self._shard()
        sd = self._local_state()
        sd["shard"] = {"rank": shard.rank if shard else 0, "size": shard.size if shard else 1,
                       "owner": list(shard.owner) if shard else []}
        return sd

    def load_sharded_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads what sharded_state_dict() saved on this rank."""
        info = state_dict.get("shard")
        shard = self._shard()
        if info is None:
            raise ValueError("not a sharded state dict (no 'shard' entry): load a full "
                             "state dict with load_state_dict()")
        here = (shard.size, shard.rank, list(shard.owner)) if shard else (1, 0, [])
        if (info["size"], info["rank"], list(info["owner"])) != here:
            raise ValueError(
                f"this sharded state dict was saved by rank {info['rank']} of "
                f"{info['size']} (for another partition); this is rank {here[1]} of "
                f"{here[0]}. Load the file rank {here[1]} saved in a job of the same size "
                "and model, or a consolidated state dict with load_state_dict()")
        self._reset_pending()
        super(self.__class__, self).load_state_dict(
            {"state": state_dict["state"], "param_groups": state_dict["param_groups"]})
        self._consolidated = None

    def _broadcast_state(self, root_rank: int) -> None:
        """broadcast_optimizer_state for a sharded optimizer: the full dict the root
        last loaded (if any) goes to every rank, which keeps its own part; else the
        root's hyper-parameters (the state itself is already where it belongs)."""
        is_root = basics.rank() == root_rank
        payload = None
        if is_root:
            payload = ({"full": _to_cpu(self._loaded_full)} if self._loaded_full is not None
                       else {"param_groups": self._local_state()["param_groups"]})
        payload = broadcast_object(payload, root_rank, name="sharded.broadcast_state",
                                   process_set=self._process_set)
        if "full" in payload:
            if not is_root:
                self._load_full(payload["full"])
        elif not is_root:
            for group, saved in zip(self.param_groups, payload["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})

    # -- elastic parts (ShardedOptimizerStateHandler) -----------------------------

    def _part(self, seq: int) -> Dict[str, Any]:
        """This rank's part of the state, copied to host memory (see pack)."""
        shard = self._shard()
        local = self._local_state()
        part = pack(local["state"], self._all_params()[0].device)
        part.update(seq=seq, param_groups=copy.deepcopy(local["param_groups"]),
                    owned=list(shard.owned) if shard else list(range(len(self._all_params()))))
        return part

    def _load_part_state(self, state: Dict[int, Any], param_groups) -> None:
        self._reset_pending()
        super(self.__class__, self).load_state_dict({"state": state,
                                                     "param_groups": param_groups})
        self._consolidated = None
