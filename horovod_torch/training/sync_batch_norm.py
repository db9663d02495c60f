"""Synchronized batch normalization: ``hvd.SyncBatchNorm``.

In training mode the batch statistics are those of the concatenation of every rank's
batch (ranks may hold different batch sizes), and the backward pass is the exact
gradient of that global normalization. In eval mode, or in a world of one, it is plain
batch norm.

Parameter gradients (``weight.grad``, ``bias.grad``) are this rank's share of the
global gradient, as in Horovod and ``torch.nn.SyncBatchNorm``: summed over ranks they
equal the gradient of one BatchNorm over the concatenated batch, and averaged (what
``hvd.DistributedOptimizer`` does by default) they are scaled like every other
parameter's gradient. The input gradient needs no further reduction.
"""
import itertools
import threading

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from horovod_torch.engine.basics import Sum, is_initialized, size
from horovod_torch.collectives.ops import allgather_async, allreduce_async, synchronize

_uid_lock = threading.Lock()
_uids = itertools.count()


def _next_uid() -> int:
    with _uid_lock:
        return next(_uids)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision inputs are normalized in float32 (as cuDNN / torch do).
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _per_channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Reshapes a (C,) tensor to broadcast against an (N, C, ...) input."""
    return t.reshape((1, -1) + (1,) * (ndim - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch norm over the concatenated batch of all ranks.

    forward: each rank computes its per-channel count, mean and sum of squared
    deviations (two-pass, in the compute dtype); one allgather of a (1, 2C + 1) float64
    row collects them, and every rank combines them with Chan's parallel formula (no
    catastrophic cancellation from sum(x^2) - n * mean^2).

    backward: sum(dy) and sum(dy * (x - mean)) per channel are allreduced (Sum) in one
    tensor; the input gradient is then that of the global normalization.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, name):
        ndim = input.dim()
        channels = input.shape[1]
        dims = [0] + list(range(2, ndim))
        cdtype = _compute_dtype(input.dtype)
        x = input.to(cdtype)
        count = input.numel() // channels if channels else 0

        if count > 0:
            local_mean = x.mean(dims)
            local_m2 = (x - _per_channel(local_mean, ndim)).pow(2).sum(dims)
        else:  # an empty batch on this rank still takes part in the collectives
            local_mean = torch.zeros(channels, dtype=cdtype, device=input.device)
            local_m2 = torch.zeros(channels, dtype=cdtype, device=input.device)
        row = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=input.device),
                         local_mean.double(), local_m2.double()]).unsqueeze(0)
        gathered = synchronize(allgather_async(row, name=f"{name}.stats"))

        counts = gathered[:, 0]
        means = gathered[:, 1:channels + 1]
        m2s = gathered[:, channels + 1:]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError("Expected more than 1 value per channel when training, got "
                             f"input size {list(input.shape)} summed over all ranks "
                             f"({int(total)} values per channel)")
        weights = counts.unsqueeze(1)
        mean = (weights * means).sum(0) / total
        m2 = m2s.sum(0) + (weights * (means - mean).pow(2)).sum(0)
        var = m2 / total  # biased, used to normalize

        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype),
                                                     alpha=momentum)
        if running_var is not None:
            with torch.no_grad():
                unbiased = m2 / (total - 1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                    alpha=momentum)

        mean_c = mean.to(cdtype)
        invstd_c = torch.rsqrt(var + eps).to(cdtype)
        out = (x - _per_channel(mean_c, ndim)) * _per_channel(invstd_c, ndim)
        if weight is not None:
            out = out * _per_channel(weight.to(cdtype), ndim)
        if bias is not None:
            out = out + _per_channel(bias.to(cdtype), ndim)

        ctx.save_for_backward(input, weight, mean_c, invstd_c)
        ctx.total = total
        ctx.name = name
        ctx.has_bias = bias is not None
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        ndim = input.dim()
        dims = [0] + list(range(2, ndim))
        cdtype = mean.dtype
        dy = grad_output.to(cdtype)
        xmu = input.to(cdtype) - _per_channel(mean, ndim)

        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)

        grad_input = grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)  # this rank's share
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else cdtype)

        if ctx.needs_input_grad[0]:
            channels = mean.numel()
            both = torch.cat([sum_dy, sum_dy_xmu]).double()
            both = synchronize(allreduce_async(both, name=f"{ctx.name}.grad", op=Sum))
            mean_dy = (both[:channels] / ctx.total).to(cdtype)
            mean_dy_xmu = (both[channels:] / ctx.total).to(cdtype)
            scale = invstd if weight is None else invstd * weight.to(cdtype)
            grad_input = (dy - _per_channel(mean_dy, ndim)
                          - xmu * _per_channel(invstd * invstd * mean_dy_xmu, ndim))
            grad_input = (grad_input * _per_channel(scale, ndim)).to(input.dtype)

        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training-mode statistics span all ranks (Horovod's
    ``hvd.SyncBatchNorm``). Accepts inputs of shape (N, C) or (N, C, ...).

    Each training-mode forward (when ``hvd.size() > 1``) runs one allgather, and the
    matching backward one allreduce, named ``sync_batch_norm.<module id>.<call>`` so
    that modules and calls never collide. Every rank must therefore call each
    SyncBatchNorm module the same number of times, in the same order, as with any
    collective. Module ids are handed out in construction order, which must also
    agree across ranks (build the model the same way on every rank).

    ``running_var`` is updated with the unbiased variance of the global batch.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self._hvd_uid = _next_uid()
        self._hvd_calls = 0

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)

        if self.momentum is None:
            exponential_average_factor = 0.0
        else:
            exponential_average_factor = self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                exponential_average_factor = 1.0 / float(self.num_batches_tracked)

        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        use_running = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_running else None
        running_var = self.running_var if use_running else None

        if not (self.training and is_initialized() and size() > 1):
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                bn_training, exponential_average_factor, self.eps)

        name = f"sync_batch_norm.{self._hvd_uid}.{self._hvd_calls}"
        self._hvd_calls += 1
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                            running_var, self.eps, exponential_average_factor,
                                            name)
