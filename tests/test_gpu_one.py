"""GPU tests that need one CUDA GPU only (tests/test_gpu.py needs two): a world of one
rank, run on the lent machine with `pytest -m gpu tests/test_gpu_one.py`."""
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_prescale_scales_every_element_on_one_rank():
    # NCCL's pre-multiplied sum on a communicator of one rank left the last of 17^3
    # float32 elements unscaled (upstream's test_horovod_allreduce_prescale at one GPU).
    _run("""
        import torch, horovod_torch as hvd
        hvd.init()
        assert hvd.size() == 1
        for dtype in (torch.float32, torch.float64, torch.float16, torch.int32):
            for dim in (1, 2, 3):
                t = torch.arange(17 ** dim, dtype=torch.float32).sub_(2000).to(dtype).cuda()
                t = t.reshape([17] * dim)
                got = hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.3)
                wide = torch.float64 if not dtype.is_floating_point else dtype
                want = (torch.tensor(0.3, dtype=wide).cuda() * t.to(wide)).to(dtype)
                bad = (got != want).nonzero()
                assert len(bad) == 0, (dtype, dim, bad[:3].tolist())
        """)


def test_memory_of_a_dropped_handle_waits_for_its_op():
    # The backend does not recordStream an op's output (nor an input reduced in place) on
    # its stream: once the stream that made the input has waited for the op, memory
    # freed is reused only after it. A handle dropped without that wait (here with
    # _C.release; an elastic reset drops the optimizer's so) marks the output used on the
    # backend stream, so that the allocator does not hand its memory to a new tensor
    # while the op still writes there. The op on `g` is held back on the GPU behind a
    # long one on `a`, and `x`, allocated after `g` was freed, would get its memory.
    _run("""
        import time
        import torch, horovod_torch as hvd
        from horovod_torch import _C
        hvd.init()
        torch.cuda.set_device(0)
        n = 1 << 24
        a = torch.empty(1 << 30, device="cuda")
        for trial in range(3):
            for waited in (True, False):
                torch.cuda._sleep(1 << 30)  # the stream is busy for a while
                a.fill_(1.0)
                g = torch.ones(n, device="cuda")
                ha = hvd.allreduce_async_(a, name=f"a.{trial}.{waited}", op=hvd.Sum,
                                          prescale_factor=3.0)
                hg = hvd.allreduce_async_(g, name=f"g.{trial}.{waited}", op=hvd.Sum,
                                          prescale_factor=3.0)
                if waited:
                    hvd.synchronize(hg)  # this stream waits for g's op
                else:
                    time.sleep(0.2)  # (the background thread enqueues both ops)
                    _C.release(hg)
                ptr = g.data_ptr()
                del g
                x = torch.full((n,), 7.0, device="cuda")
                hvd.synchronize(ha)
                torch.cuda.synchronize()
                bad = int((x != 7.0).sum())
                assert bad == 0, (trial, waited, x.data_ptr() == ptr, bad, x[:2].tolist())
        print("ok")
        """)


# DistributedOptimizer on CUDA gradients at one rank (the hooks, the wait for their ops
# and the write-back run as at N): the workers of tests/test_gpu.py's two-rank tests.
@pytest.mark.parametrize("target,args,native", [
    ("exactness", ["sgd", "average", "1", "none", "cuda"], "1"),
    ("exactness", ["sgd", "average", "1", "none", "cuda"], "0"),
    ("exactness", ["adam", "sum", "2", "none", "cuda"], "1"),
    ("exactness", ["adam", "average", "1", "fp16", "cuda"], "1"),
    ("fp16_wire", ["cuda"], "1"),
    ("fp16_wire", ["cuda"], "0"),
    ("amp_gradscaler", [], "1"),
])
def test_optimizer_on_one_gpu(target, args, native):
    from tests.harness import run_workers
    run_workers(f"tests.optimizer_workers:{target}", 1, args=args, timeout=240,
                env={"NCCL_NVLS_ENABLE": "0", "HOROVOD_NATIVE_GRAD_HOOKS": native})


def test_premul_sum_on_cuda_tensors():
    # PREMUL_SUM runs as an engine op (csrc/python/c10d_backend.cc), not on the group's
    # own NCCL communicator.
    from tests.test_torch_distributed import _run as run_dist
    run_dist("tests.torch_distributed_workers:premul_sum", 1, ["cuda"], timeout=180,
             env={"NCCL_NVLS_ENABLE": "0"})
