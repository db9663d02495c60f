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
