"""Run by test_launchers.py under torchrun / with SLURM or OpenMPI variables."""
import torch

import horovod.torch as hvd

hvd.init()
out = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="probe")
print(f"PROBE rank={hvd.rank()} size={hvd.size()} local_rank={hvd.local_rank()} "
      f"local_size={hvd.local_size()} cross_rank={hvd.cross_rank()} sum={out.item():.0f}",
      flush=True)
hvd.shutdown()
