"""GPU workers for a peer that fails while the others are inside an NCCL collective
(tests/test_gpu.py, #32 item 3).

The last rank keeps its GPU busy (a minute-long kernel) before it submits a large
allreduce, so its share of the collective never starts while the others' kernels
wait for it. Then it dies (SIGKILL), stops (SIGSTOP) or just stays busy. The others
must raise HorovodInternalError within a bound, with their GPUs idle again (the
kernels ended by aborting the communicator), and the commit fence of hvd.elastic
must refuse to save what the cut-off collective left."""
import os
import signal
import time

import torch

import horovod_torch as hvd
from horovod_torch.elastic.state import fence_gpu_collectives

DELAY_S = 3.0  # from the victim's submission to its death


def _expect_internal_error(fn):
    try:
        fn()
    except hvd.HorovodInternalError as exc:
        return str(exc)
    raise AssertionError(f"{fn} did not raise HorovodInternalError")


def peer_fails_inside_nccl(how: str = "kill", mb: str = "1024", bound_s: str = "10") -> None:
    """how: kill, stop or busy (alive, its GPU busy: the others' op times out after
    HOROVOD_GPU_OP_TIMEOUT). bound_s: how long after the failure the others may take."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    torch.cuda.set_device(hvd.local_rank())
    dev = torch.device("cuda", hvd.local_rank())
    pids = hvd.allgather_object(os.getpid())
    t = torch.ones(int(mb) * (1 << 18), device=dev)  # mb MB of float32
    warm = hvd.allreduce(t, op=hvd.Sum, name="warmup")  # the communicator is made here
    assert warm[0].item() == n and warm[-1].item() == n
    victim = n - 1
    if r == victim:
        torch.cuda._sleep(100_000_000_000 if how != "busy" else 40_000_000_000)
        hvd.allreduce_async(t, op=hvd.Sum, name="big")
        time.sleep(DELAY_S)
        if how == "busy":
            message = _expect_internal_error(fence_gpu_collectives)
            print(f"rank {r}: busy victim failed too: {message}", flush=True)
            os._exit(0)  # its GPU may still run the long kernel: leave without waiting
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(600)
        os._exit(1)
    submitted = time.monotonic()
    out = hvd.allreduce(t, op=hvd.Sum, name="big")  # returns once queued on the GPU
    assert out.is_cuda
    # The fence waits for this rank's GPU, which waits for the victim's share.
    message = _expect_internal_error(fence_gpu_collectives)
    elapsed = time.monotonic() - submitted - DELAY_S
    assert elapsed < float(bound_s), f"took {elapsed:.1f} s after the failure: {message}"
    # No kernel is left waiting: the GPU runs new work and is idle at once.
    t1 = time.monotonic()
    assert torch.ones(4, device=dev).sum().item() == 4.0
    torch.cuda.synchronize()
    assert time.monotonic() - t1 < 5, "the GPU was still busy after the failure"
    # The engine stays failed (the elastic wrapper resets it).
    _expect_internal_error(lambda: hvd.allreduce(torch.ones(2, device=dev), name="later"))
    hvd.shutdown()
    if how == "stop":
        os.kill(pids[victim], signal.SIGKILL)
    print(f"rank {r}: {how}: HorovodInternalError {elapsed:.2f} s after the failure "
          f"({message})", flush=True)
