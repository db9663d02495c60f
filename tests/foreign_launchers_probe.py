"""Run by test_foreign_launchers.py under torchrun / with SLURM or OpenMPI variables."""
import sys

import torch

import horovod.torch as hvd

hvd.init()
out = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="probe")
# One write per line: ranks share the launcher's pipe, and an unbuffered print()
# writes the text and the newline separately.
sys.stdout.write(f"PROBE rank={hvd.rank()} size={hvd.size()} local_rank={hvd.local_rank()} "
                 f"local_size={hvd.local_size()} cross_rank={hvd.cross_rank()} "
                 f"sum={out.item():.0f}\n")
sys.stdout.flush()
hvd.shutdown()
