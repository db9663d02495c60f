"""``HorovodStrategy``: Lightning 2.x training on horovod_torch (the strategy Lightning
1.x shipped as ``strategy="horovod"`` and removed in 2.0), written against Lightning's
``ParallelStrategy`` API.

Processes are started by a launcher (``horovodrun``, ``mpirun``, ``torchrun``,
``srun``, ``horovod_torch.spark.run``, Ray): the strategy never spawns any. What it
does:

* ranks and world size come from ``hvd.rank()``/``hvd.size()`` (``HorovodEnvironment``),
  ``rank_zero_only`` follows the global rank, and Lightning injects a
  ``DistributedSampler`` with ``num_replicas=hvd.size()``, ``rank=hvd.rank()``;
* for fitting, rank 0's parameters and optimizer state are broadcast, then every
  optimizer is wrapped in ``hvd.DistributedOptimizer`` (gradient hooks start each
  allreduce as soon as the gradient is ready; ``compression``, ``op``,
  ``gradient_predivide_factor``, ``sparse_as_dense`` are passed on), with
  ``backward_passes_per_step`` = ``Trainer(accumulate_grad_batches=...)``;
* the optimizer step runs the closure (forward and backward), waits for the
  allreduces, then lets Lightning's precision plugin clip the averaged gradients and
  step (the wrapped optimizer's own synchronize is skipped);
* ``self.log(..., sync_dist=True)`` and ``reduce`` go through ``hvd.allreduce``,
  ``all_gather`` through ``hvd.allgather``, ``broadcast`` through
  ``hvd.broadcast_object``, ``barrier`` through ``hvd.barrier``;
* checkpoints are written and removed by rank 0 only.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

import horovod_torch as hvd
from horovod_torch.common import extras, launch_env

try:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    _PACKAGE = "lightning"
except ImportError as _no_lightning:  # the standalone package (pip install pytorch-lightning)
    import importlib.util  # pylint: disable=ungrouped-imports
    if importlib.util.find_spec("lightning") is not None:
        raise  # lightning is installed but does not import: its own error says why
    if importlib.util.find_spec("pytorch_lightning") is None:
        raise ImportError(extras.missing_message("lightning", "horovod_torch.lightning"),
                          name="lightning") from _no_lightning
    from lightning_fabric.plugins import CheckpointIO
    from lightning_fabric.plugins.environments import ClusterEnvironment
    from lightning_fabric.utilities.seed import reset_seed
    from pytorch_lightning.core.optimizer import LightningOptimizer
    from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry
    from pytorch_lightning.trainer.states import TrainerFn
    from pytorch_lightning.utilities.rank_zero import rank_zero_only
    _PACKAGE = "pytorch_lightning"

try:
    from lightning_utilities.core.rank_zero import rank_zero_only as _utils_rank_zero_only
except ImportError:  # pragma: no cover
    _utils_rank_zero_only = rank_zero_only

_OPS = {"mean": hvd.Average, "avg": hvd.Average, "average": hvd.Average, "sum": hvd.Sum,
        "max": hvd.Max, "min": hvd.Min, "product": hvd.Product, "prod": hvd.Product}
_COMPRESSION = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                "float16": hvd.Compression.fp16, "bf16": hvd.Compression.bf16,
                "bfloat16": hvd.Compression.bf16}


def _reduce_op(reduce_op: Any) -> int:
    """Lightning's reduce ops ("mean", "sum", torch's ReduceOp.SUM, ...) as hvd ops."""
    if reduce_op is None:
        return hvd.Average
    if isinstance(reduce_op, str):
        name = reduce_op
    else:
        name = getattr(reduce_op, "name", None) or str(reduce_op).rsplit(".", 1)[-1]
    op = _OPS.get(str(name).lower())
    if op is None:
        raise ValueError(f"HorovodStrategy: unsupported reduce_op {reduce_op!r} (use mean, "
                         "sum, max, min or product)")
    return op


def _check_group(group: Any, what: str) -> None:
    if group is None:
        return
    try:
        import torch.distributed as dist  # pylint: disable=import-outside-toplevel
        if dist.is_available() and group is dist.group.WORLD:
            return
    except Exception:  # pylint: disable=broad-except
        pass
    raise ValueError(f"HorovodStrategy: {what} over a process group other than the world "
                     "is not supported; leave `group` unset")


class HorovodEnvironment(ClusterEnvironment):
    """Lightning's view of a horovod_torch job: ranks and sizes from ``hvd``, processes
    created externally (by the launcher)."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        env = launch_env.read()
        return env.store_host or env.master_addr or "127.0.0.1"

    @property
    def main_port(self) -> int:
        env = launch_env.read()
        return env.store_port or env.master_port or 0

    @staticmethod
    def detect() -> bool:
        placement = launch_env.read().placement
        return placement is not None and placement.launcher == "horovodrun"

    def world_size(self) -> int:
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        pass  # the launcher decides

    def global_rank(self) -> int:
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return hvd.local_rank()

    def node_rank(self) -> int:
        return hvd.cross_rank()


class HorovodStrategy(ParallelStrategy):
    """Data-parallel training with horovod_torch (``Trainer(strategy=HorovodStrategy())``,
    or ``strategy="horovod"`` once ``horovod_torch.lightning`` is imported).

    Args:
        compression: gradient compression on the wire: ``hvd.Compression.none``
            (default), ``.fp16``, ``.bf16``, or one of the strings ``"none"``,
            ``"fp16"``, ``"bf16"``.
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum``.
        gradient_predivide_factor: as in ``hvd.DistributedOptimizer``.
        sparse_as_dense: as in ``hvd.DistributedOptimizer``.
        scale_lr: multiply every learning rate (and the schedulers' base learning
            rates) by the world size before training, as Lightning 1.x's
            HorovodStrategy did. Default ``False``: the script's learning rates are
            used as they are (like Lightning's DDP).
        accelerator, parallel_devices, checkpoint_io, precision_plugin: Lightning's.
    """

    strategy_name = "horovod"

    def __init__(self, accelerator=None, parallel_devices: Optional[List[torch.device]] = None,
                 checkpoint_io: Optional[CheckpointIO] = None, precision_plugin=None,
                 compression: Any = None, op: int = hvd.Average,
                 gradient_predivide_factor: float = 1.0, sparse_as_dense: bool = False,
                 scale_lr: bool = False) -> None:
        hvd.init()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=HorovodEnvironment(),
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        if compression is None:
            compression = hvd.Compression.none
        elif isinstance(compression, str):
            try:
                compression = _COMPRESSION[compression.lower()]
            except KeyError:
                raise ValueError(f"HorovodStrategy: unknown compression {compression!r} "
                                 "(none, fp16 or bf16)") from None
        self.compression = compression
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.scale_lr = scale_lr
        self._set_rank_zero()

    # -- topology ---------------------------------------------------------------

    @property
    def global_rank(self) -> int:
        return hvd.rank()

    @property
    def local_rank(self) -> int:
        return hvd.local_rank()

    @property
    def node_rank(self) -> int:
        return hvd.cross_rank()

    @property
    def world_size(self) -> int:
        return hvd.size()

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning: inject the DistributedSampler, honour sync_dist."""
        return True

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if self.local_rank < len(devices):
            return devices[self.local_rank]
        first = devices[0]
        if first.type == "cpu":
            return first
        # devices=1 under a launcher: one device per process, chosen by local rank
        return torch.device(first.type, self.local_rank)

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _set_rank_zero(self) -> None:
        rank_zero_only.rank = _utils_rank_zero_only.rank = self.global_rank

    # -- setup ------------------------------------------------------------------

    def setup_environment(self) -> None:
        hvd.init()
        self._set_rank_zero()
        reset_seed()
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o
                      for o in self.optimizers]
        if self.scale_lr:
            for opt in optimizers:
                for group in opt.param_groups:
                    group["lr"] *= self.world_size
            for config in self.lr_scheduler_configs:
                if hasattr(config.scheduler, "base_lrs"):
                    config.scheduler.base_lrs = [lr * self.world_size
                                                 for lr in config.scheduler.base_lrs]
        assert self.lightning_module is not None
        hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
        for opt in optimizers:
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        passes = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        wrapped = [self._wrap(opt, passes) for opt in optimizers]
        for config in self.lr_scheduler_configs:
            for old, new in zip(optimizers, wrapped):
                if getattr(config.scheduler, "optimizer", None) is old:
                    config.scheduler.optimizer = new
        self.optimizers = wrapped

    def _wrap(self, opt: Optimizer, passes: int) -> Optimizer:
        if hasattr(opt, "skip_synchronize"):  # already a DistributedOptimizer
            return opt
        params = {p for group in opt.param_groups for p in group["params"]}
        named = [(n, p) for n, p in self.lightning_module.named_parameters() if p in params]
        return hvd.DistributedOptimizer(
            opt, named_parameters=named, compression=self.compression,
            backward_passes_per_step=passes, op=self.op,
            gradient_predivide_factor=self.gradient_predivide_factor,
            sparse_as_dense=self.sparse_as_dense)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # GradientAccumulationScheduler may change accumulate_grad_batches per epoch.
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        passes = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        for opt in self.optimizers:
            if (hasattr(opt, "skip_synchronize")
                    and getattr(opt, "backward_passes_per_step", passes) != passes):
                opt.backward_passes_per_step = passes
        super().on_train_batch_start(batch, batch_idx)

    # -- the step ---------------------------------------------------------------

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model=None, **kwargs: Any) -> Any:
        """The closure (forward, backward) runs inside the precision plugin's step; the
        allreduces are awaited right after it, so gradient clipping and the step see
        averaged gradients."""
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if not hasattr(opt, "skip_synchronize"):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_synchronize():
            result = closure()
            opt.synchronize()
            return result

        with opt.skip_synchronize():
            return super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)

    # -- collectives ------------------------------------------------------------

    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Any] = "mean") -> Union[Tensor, Any]:
        """Allreduce over all ranks (``self.log(..., sync_dist=True)`` comes here);
        a value that is not a tensor is returned unchanged."""
        if not isinstance(tensor, Tensor):
            return tensor
        _check_group(group, "reduce")
        op = _reduce_op(reduce_op)
        # Lightning evaluates under torch.inference_mode(); the collectives' outputs
        # must be ordinary tensors, which the engine writes from its own thread.
        with torch.inference_mode(False):
            if op == hvd.Average and not (tensor.is_floating_point() or tensor.is_complex()):
                return hvd.allreduce(tensor, op=hvd.Sum) / self.world_size
            return hvd.allreduce(tensor, op=op)

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None,
                   sync_grads: bool = False) -> Tensor:
        """Every rank's tensor, stacked: shape ``(world_size, *tensor.shape)`` (the
        tensors must have the same shape on every rank)."""
        _check_group(group, "all_gather")
        ctx = contextlib.nullcontext() if sync_grads else torch.no_grad()
        with ctx, torch.inference_mode(False):  # see reduce()
            return hvd.allgather(tensor.unsqueeze(0))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name: Optional[str] = None) -> None:
        if self.world_size > 1:
            hvd.barrier()

    # -- teardown ---------------------------------------------------------------

    def teardown(self) -> None:
        # Detach the gradient hooks, so that a later fit with new optimizers does not
        # also start the old ones' allreduces.
        for opt in self.optimizers:
            opt = opt._optimizer if isinstance(opt, LightningOptimizer) else opt
            for handle in getattr(opt, "_hook_handles", []):
                handle.remove()
            if hasattr(opt, "_hook_handles"):
                opt._hook_handles = []
            if getattr(opt, "_native", None) is not None:
                opt._native = None  # destroying the C++ hooks detaches them
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls,
                                   description="horovod_torch data-parallel training",
                                   override=True)


def _register() -> None:
    try:
        HorovodStrategy.register_strategies(StrategyRegistry)
    except Exception:  # pylint: disable=broad-except  (a registry of another shape)
        pass


_register()
