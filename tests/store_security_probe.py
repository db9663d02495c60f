"""Run by tests/test_store_security.py under torchrun, or with SLURM's variables: every
rank initialises and allreduces; rank 0 then writes what the test needs to know into
CTL_DIR/ready.json, and every rank waits for CTL_DIR/go before it shuts down, so that
the test can look at rank 0's store while the job runs."""
import json
import os
import sys
import time

import torch

import horovod.torch as hvd

ctl = sys.argv[1]
hvd.init()
out = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="probe")
assert out.item() == 3.0, out
if hvd.rank() == 0:
    info = {k: os.environ.get(k, "") for k in (
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT",
        "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "OMPI_MCA_orte_ess_jobid")}
    with open(os.path.join(ctl, "ready.json.tmp"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(ctl, "ready.json.tmp"), os.path.join(ctl, "ready.json"))
deadline = time.monotonic() + 90
while not os.path.exists(os.path.join(ctl, "go")):
    if time.monotonic() > deadline:
        sys.exit("the test never said go")
    time.sleep(0.05)
hvd.barrier()
sys.stdout.write(f"PROBE_OK rank={hvd.rank()} size={hvd.size()}\n")
sys.stdout.flush()
hvd.shutdown()
