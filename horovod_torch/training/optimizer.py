"""DistributedOptimizer: wraps a torch optimizer so gradients are averaged across
ranks, with each gradient's allreduce started by a hook as soon as backward has
produced it (communication overlaps the rest of the backward pass)."""
import contextlib
import warnings
import weakref
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from horovod_torch import _C
from horovod_torch.collectives.adasum import check_size as _check_adasum_size
from horovod_torch.engine.basics import Adasum, Average, Sum, raise_for_status
from horovod_torch.collectives.compression import Compression, NoneCompressor, _CastCompressor
from horovod_torch.collectives.ops import allreduce_async_, grouped_allreduce_async_
from horovod_torch.collectives.process_sets import ProcessSet, _ps_id, global_process_set
from horovod_torch.collectives.sparse import sparse_allreduce_async
from horovod_torch.collectives.submit import _wait_many, synchronize
from horovod_torch.training.sharded import ShardedOptimizer, ShardedStateMixin


def _ps_included(process_set) -> bool:
    """Whether this rank belongs to `process_set` (a clear error if it is not
    registered)."""
    if process_set is None or process_set is global_process_set:
        return True
    if not isinstance(process_set, ProcessSet) or process_set.process_set_id is None:
        _ps_id(process_set)  # raises, saying what is wrong
    return bool(process_set.included())


_SPARSE = object()  # handle context of a sparse gradient (sparse_allreduce_async)

class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into a subclass of the user's optimizer class (see DistributedOptimizer)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self._op = op
        self._predivide = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        self._native = None  # _C.GradHooks when the hooks run in C++
        self.backward_passes_per_step = backward_passes_per_step

        all_params = [p for g in self.param_groups for p in g["params"]]
        self._parameter_names = _parameter_names(all_params, named_parameters)
        self._wire_names = {p: "allreduce." + n for p, n in self._parameter_names.items()}
        self._requires_update = [p for p in all_params if p.requires_grad]

        self._groups: Dict[torch.Tensor, int] = {}
        self._group_members: List[List[torch.Tensor]] = []
        if groups is not None:
            if isinstance(groups, int):
                groups_list = [self._requires_update[i::groups] for i in range(groups)]
            else:
                groups_list = [list(g) for g in groups]
                grouped = {id(p) for g in groups_list for p in g}
                groups_list += [[p] for p in self._requires_update if id(p) not in grouped]
            for gi, members in enumerate(g for g in groups_list if g):
                self._group_members.append(members)
                for p in members:
                    self._groups[p] = gi

        self._handles: Dict[torch.Tensor, Tuple[Optional[int], object, torch.Tensor]] = {}
        self._group_ready: Dict[int, set] = {}
        # Backward passes per parameter (the C++ hooks keep their own, of the same kind).
        self._index = {p: i for i, p in enumerate(self._requires_update)}
        self._counter = _C.PassCounter(len(self._requires_update), int(backward_passes_per_step))
        self._synchronized = False
        self._should_synchronize = True
        self._hook_handles = []
        weakref.finalize(self, _remove_hooks, self._hook_handles)
        # As in Horovod, ranks outside the process set train on their own gradients.
        self._included = _ps_included(process_set)
        if self._included:
            self._register_hooks()

    # -- hooks ---------------------------------------------------------------

    @property
    def backward_passes_per_step(self) -> int:
        return self._backward_passes_per_step

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, n: int) -> None:
        self._backward_passes_per_step = n
        if getattr(self, "_counter", None) is not None:
            self._counter.set_passes_per_step(int(n))
        if self._native is not None:
            self._native.set_passes_per_step(int(n))

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's spelling of ``optimizer.backward_passes_per_step = passes``."""
        self.backward_passes_per_step = passes

    def _wire_dtype(self) -> Optional[str]:
        """"" or the cast dtype when the compressor is one the C++ hooks apply
        themselves (none, fp16, bf16, not overridden); None otherwise."""
        c = self._compression
        if (getattr(c, "compress", None) is NoneCompressor.compress
                and getattr(c, "decompress", None) is NoneCompressor.decompress):
            return ""
        if (getattr(getattr(c, "compress", None), "__func__", None)
                is _CastCompressor.compress.__func__
                and getattr(getattr(c, "decompress", None), "__func__", None)
                is _CastCompressor.decompress.__func__):
            return {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(c.wire_dtype)
        return None

    def _register_hooks(self, native: bool = True) -> None:
        """C++ hooks where they apply (and `native`), else Python hooks."""
        wire = self._wire_dtype()
        if (native and _C.native_grad_hooks() and wire is not None and not self._groups
                and self._op in (Average, Sum)):
            op, pre, post = self._scales()
            params = self._requires_update
            names, extra = self._native_targets(params)
            self._native = _C.GradHooks(params, names, int(op), float(pre), float(post),
                                        _ps_id(self._process_set),
                                        int(self.backward_passes_per_step), wire, **extra)
            self._native_wire = wire != ""
            return
        for i, p in enumerate(self._requires_update):
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    def _native_targets(self, params) -> Tuple[List[str], dict]:
        """The C++ hooks' op names, and their other keyword arguments (a sharded
        optimizer's reduce_scatter_gradients gives each gradient's owner)."""
        return [self._wire_names[p] for p in params], {}

    def _make_hook(self, i: int):
        # The hook holds the optimizer weakly: torch keeps a parameter's hooks where
        # the garbage collector cannot see them, so a strong reference would keep the
        # optimizer, and through it the model, alive for good.
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            # True on the step's last pass; an AssertionError once the allreduce is in
            # flight (another pass would add into it and make ranks disagree).
            opt = ref()
            if opt is not None and opt._counter.count(i):
                opt._start(p)
        # Compiled autograd runs it as it is, untraced: traced by Dynamo, every call
        # reached the first parameter's entries in the optimizer's tensor-keyed tables.
        return torch.compiler.disable(hook)

    def _started(self, p: torch.Tensor, entry) -> None:
        self._handles[p] = entry
        self._counter.mark_started(self._index[p])

    def _scales(self) -> Tuple[int, float, float]:
        if self._op == Average:
            # The engine applies 1/size for Average; split it around the reduction.
            return Average, 1.0 / self._predivide, self._predivide
        return self._op, 1.0, 1.0

    def _prepare(self, p: torch.Tensor):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:  # sparse_as_dense=True (else _start allgathers it)
            grad = grad.to_dense()  # reduced dense; synchronize() makes it sparse again
        compressed, ctx = self._compression.compress(grad)
        if compressed is grad and not grad.is_contiguous():
            compressed = grad.contiguous()
        return compressed, ctx

    def _start(self, p: torch.Tensor) -> None:
        op, pre, post = self._scales()
        if p.grad is not None and p.grad.is_sparse and not self._sparse_as_dense:
            # As in Horovod: sparse gradients are allgathered (indices and values).
            if p in self._groups:
                raise ValueError(f"parameter '{self._parameter_names.get(p)}' has a sparse "
                                 "gradient and cannot be in a group; pass "
                                 "sparse_as_dense=True or leave it out of groups")
            h = sparse_allreduce_async(p.grad, name=self._wire_names[p],
                                       op=Sum if self._op == Sum else Average,
                                       process_set=self._process_set)
            self._started(p, (h, _SPARSE, None))
            return
        if p in self._groups:
            gi = self._groups[p]
            ready = self._group_ready.setdefault(gi, set())
            ready.add(p)
            self._handles[p] = (None, None, None)
            if len(ready) == len(self._group_members[gi]):
                members = self._group_members[gi]
                prepared = [self._prepare(q) for q in members]
                hs = grouped_allreduce_async_([c for c, _ in prepared],
                                              name=f"allreduce.group.{gi}", op=op,
                                              prescale_factor=pre, postscale_factor=post,
                                              process_set=self._process_set)
                for q, h, (c, ctx) in zip(members, hs, prepared):
                    self._started(q, (h, ctx, c))
                del self._group_ready[gi]
            return
        compressed, ctx = self._prepare(p)
        h = allreduce_async_(compressed, name=self._wire_names[p], op=op, prescale_factor=pre,
                             postscale_factor=post, process_set=self._process_set)
        self._started(p, (h, ctx, compressed))

    # -- public API ------------------------------------------------------------

    def synchronize(self) -> None:
        """Waits for every gradient's allreduce and writes the results into .grad.

        Parameters that got no gradient this step take part with zeros, so every
        rank submits the same set of tensors.
        """
        if not self._included:
            self._synchronized = True
            return
        try:
            if self._native is not None and not self._handles:
                # The common step, all in C++: every gradient's op came from the hooks.
                failure = self._native.wait_all()
                if failure is not None:
                    raise_for_status(*failure)
                    self._synchronized = True
                    return
            if self._native is not None:
                params = self._requires_update
                for i, h, wire in self._native.take():
                    p = params[i]
                    # (no .grad: another rank's gradient, reduce-scattered)
                    dtype = p.grad.dtype if self._native_wire and p.grad is not None else None
                    self._handles[p] = (h, dtype, wire)
            for p in self._requires_update:
                if p not in self._handles:
                    self._start(p)
            items = list(self._handles.items())
            if any(h is None for h, _, _ in self._handles.values()):
                # a group member whose group is incomplete: cannot happen now
                raise AssertionError("internal: incomplete gradient group after synchronize")
            for p, (h, ctx, _) in items:
                if ctx is _SPARSE:
                    p.grad = synchronize(h)
            dense = [(p, h, ctx) for p, (h, ctx, _) in items if ctx is not _SPARSE]
            self._write_reduced([(p, ctx) for p, _, ctx in dense],
                                _wait_many([h for _, h, _ in dense]))
        finally:
            # Also after a failure (a lost peer): the next step starts clean.
            self._reset_pending()
        self._synchronized = True

    def _write_reduced(self, dense, outs) -> None:
        """The reduced gradients into .grad: ``dense`` is [(parameter, compression
        context)], ``outs`` the reduced (compressed) tensors. The built-in casts back
        to the gradients' dtype (and results not reduced in place) go in one
        multi-tensor copy; other compressors (also subclasses that override
        decompress) decompress tensor by tensor first."""
        cast = (getattr(getattr(self._compression, "decompress", None), "__func__", None)
                is _CastCompressor.decompress.__func__)
        dst, src = [], []
        for (p, ctx), out in zip(dense, outs):
            if p.grad is None:  # dropped since its reduction started: the result becomes .grad
                p.grad = torch.zeros_like(p)
            if cast and isinstance(ctx, torch.dtype) and out.dtype != ctx:
                dst.append(p.grad)
                src.append(out.view_as(p.grad))
                continue
            result = self._compression.decompress(out, ctx)
            if p.grad.is_sparse:  # sparse_as_dense: the optimizer expects it sparse
                p.grad = result.view(p.grad.shape).to_sparse()
            elif result.data_ptr() != p.grad.data_ptr():
                dst.append(p.grad)
                src.append(result.view_as(p.grad))
        if dst:
            torch._foreach_copy_(dst, src)

    def _reset_pending(self) -> None:
        """Forgets gradients in flight (after synchronize, or when elastic training
        restores the state after a failure)."""
        self._handles.clear()
        self._counter.reset()
        self._group_ready.clear()
        if self._native is not None:
            self._native.reset()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block step() does not synchronize (call synchronize() first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
            if closure is not None:
                closure = self._synchronizing(closure)
        self._synchronized = False
        try:
            return self._local_step(closure)
        finally:
            self._synchronized = False

    def _synchronizing(self, closure):
        """`closure` followed by the reduction of the gradients its backward pass
        started: the wrapped optimizer then steps on reduced gradients, however often
        it evaluates the closure (LBFGS does several times per step)."""
        def evaluate():
            loss = closure()
            self.synchronize()
            return loss
        return evaluate

    def _local_step(self, closure=None):
        """The wrapped optimizer's step, on gradients already reduced."""
        return super(self.__class__, self).step(closure)

    def load_state_dict(self, state_dict) -> None:
        """Loads the wrapped optimizer's state; gradients in flight are forgotten."""
        self._reset_pending()
        return super(self.__class__, self).load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True):
        if (any(h[0] is not None for h in self._handles.values())
                or (self._native is not None and self._native.in_flight())):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """Horovod's Adasum optimizer (op=hvd.Adasum), mixed into a subclass of the user's
    optimizer class: each rank steps its own optimizer on its own gradients, and the
    change of every parameter (the delta model) is combined across ranks with Adasum;
    every rank then holds start + adasum(deltas)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        all_params = [p for g in self.param_groups for p in g["params"]]
        self._parameter_names = _parameter_names(all_params, named_parameters)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes

    def synchronize(self) -> None:
        """Nothing to wait for: step() combines the updates."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum "
                             "optimizer.")

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        start = [p.detach().clone() for p in params]
        loss = super(self.__class__, self).step(closure)
        deltas, ctxs = [], []
        for p, s in zip(params, start):
            compressed, ctx = self._compression.compress(p.detach() - s)
            deltas.append(compressed.contiguous())
            ctxs.append(ctx)
        handles = [allreduce_async_(d, name="adasum.delta." + self._parameter_names[p], op=Adasum)
                   for p, d in zip(params, deltas)]
        with torch.no_grad():
            for p, s, h, ctx in zip(params, start, handles, ctxs):
                p.copy_(s + self._compression.decompress(synchronize(h), ctx).view_as(p))
        return loss


def _remove_hooks(handles) -> None:
    """Detaches a collected optimizer's Python hooks from its parameters."""
    for handle in handles:
        handle.remove()


def _parameter_names(all_params, named_parameters) -> Dict[torch.Tensor, str]:
    """{parameter: name} from named_parameters (checked: unique names, every parameter
    that needs a gradient named), or generated names."""
    if named_parameters is None:
        return {p: f"noname.{i}" for i, p in enumerate(all_params)}
    named = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) "
                         "tuples, usually model.named_parameters()")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"named_parameters has duplicate names: {dups}; each "
                         "parameter needs a unique name")
    by_param = {id(p): n for n, p in named}
    unnamed = [i for i, p in enumerate(all_params) if p.requires_grad and id(p) not in by_param]
    if unnamed:
        raise ValueError("named_parameters was given, but it does not name every "
                         f"parameter of the optimizer ({len(unnamed)} unnamed); pass "
                         "model.named_parameters() of the model the optimizer trains")
    return {p: by_param[id(p)] for p in all_params if id(p) in by_param}


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False,
                         process_set=global_process_set, shard_optimizer_state=False,
                         reduce_scatter_gradients: bool = False):
    """Returns `optimizer` made distributed: an instance of a subclass of its class
    whose step() first averages (op=Average) or sums gradients across ranks.

    ``shard_optimizer_state=True`` (or 1) keeps each parameter's optimizer state on
    one rank only (about 1/N of it per rank, see horovod_torch/training/sharded.py); ``2``
    also frees, in step(), the gradients of parameters another rank owns.
    ``reduce_scatter_gradients=True`` (with shard_optimizer_state) reduces each
    gradient to its owner only: after synchronize() a rank holds only its own
    parameters' gradients (the others' are None). Clip with
    ``optimizer.clip_grad_norm_`` then; ``torch.nn.utils.clip_grad_norm_`` would see
    only this rank's gradients.
    """
    if op not in (Average, Sum, Adasum):
        raise ValueError("DistributedOptimizer supports op=hvd.Average, hvd.Sum or hvd.Adasum")
    stage = _shard_stage(shard_optimizer_state)
    if stage and isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("shard_optimizer_state cannot shard torch.optim.LBFGS: its state (the "
                         "curvature history) spans all parameters at once")
    if reduce_scatter_gradients and not stage:
        raise ValueError("reduce_scatter_gradients needs shard_optimizer_state: a gradient is "
                         "reduced to the rank that owns the parameter's optimizer state")
    if reduce_scatter_gradients and (num_groups or groups is not None):
        raise ValueError("reduce_scatter_gradients cannot be combined with num_groups or "
                         "groups (grouped gradients are allreduced)")
    if stage and op == Adasum:
        raise ValueError("shard_optimizer_state cannot be combined with op=hvd.Adasum (each "
                         "rank steps the whole model there)")
    if op == Adasum:
        _check_adasum_size()
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    if num_groups and groups is not None:
        raise ValueError("give num_groups or groups, not both")
    if groups is not None and not (isinstance(groups, int) or isinstance(groups, list)):
        raise ValueError("groups must be an int or a list of lists of parameters")
    if op == Adasum:
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
                   dict(_DistributedAdasumOptimizer.__dict__))
        dist = cls(optimizer.param_groups, named_parameters, compression,
                   backward_passes_per_step)
        dist.state = optimizer.state
        return dist
    methods, bases = dict(_DistributedOptimizer.__dict__), (optimizer.__class__,)
    if stage:
        methods.update({k: v for k, v in ShardedStateMixin.__dict__.items()
                        if not k.startswith("__")})
        methods["_unsharded"] = _DistributedOptimizer
        methods["_scatter"] = bool(reduce_scatter_gradients)
        bases += (ShardedOptimizer,)
    cls = type(optimizer.__class__.__name__, bases, methods)
    groups = groups if groups is not None else (num_groups or None)
    dist = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, groups, sparse_as_dense, process_set)
    dist.state = optimizer.state
    if stage:
        dist._shard_init(stage)
        shard = dist._shard()
        if shard is not None and dist.state:  # state the optimizer had: keep this rank's part
            index = {p: i for i, p in enumerate(shard.params)}
            for p in [p for p in dist.state if not shard.owns(index.get(p, -1))]:
                del dist.state[p]
    return dist


def _shard_stage(value) -> int:
    """shard_optimizer_state as a stage number: 0 (off), 1 (state) or 2 (and gradients)."""
    if value is True:
        return 1
    if value is False or value is None or (type(value) is int and value in (0, 1, 2)):
        return int(value or 0)
    raise ValueError(f"shard_optimizer_state must be False, True (1) or 2; got {value!r}")
