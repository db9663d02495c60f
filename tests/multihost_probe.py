"""Worker run by test_multihost.py on several (namespace) hosts: one allreduce and one
allgather of uneven blocks (both hierarchical between equal hosts), then one JSON line with what this rank saw: topology, the result, and every rank's mesh
address as published in the store (so the test can see which links carried it)."""
import json
import os
import socket
import sys

import torch

import horovod.torch as hvd
from horovod_torch import _C

hvd.init()
numel = int(os.environ.get("PROBE_NUMEL", "262144"))
out = hvd.allreduce(torch.full((numel,), float(hvd.rank() + 1)), op=hvd.Sum, name="probe")
# Rank r contributes r + 1 rows of PROBE_AG_COLS values r: the gathered rows must come in rank
# order with every value in place.
cols = int(os.environ.get("PROBE_AG_COLS", "5000"))
rows = hvd.allgather(torch.full((hvd.rank() + 1, cols), float(hvd.rank())), name="probe.ag")
want = torch.cat([torch.full((r + 1, cols), float(r)) for r in range(hvd.size())])
store = _C.StoreClient(os.environ["HOROVOD_STORE_ADDR"], int(os.environ["HOROVOD_STORE_PORT"]),
                       os.environ["HOROVOD_SECRET"], 10.0)
prefix = os.environ.get("HOROVOD_RENDEZVOUS_PREFIX", "job") + "/init0"
mesh = [store.get(f"{prefix}/addr/{r}", 10.0).decode() for r in range(hvd.size())]
report = dict(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
              local_size=hvd.local_size(), cross_rank=hvd.cross_rank(),
              cross_size=hvd.cross_size(), host=os.environ.get("HOROVOD_HOSTNAME"),
              store=os.environ["HOROVOD_STORE_ADDR"], mesh=mesh,
              sum_min=out.min().item(), sum_max=out.max().item(),
              allgather_ok=bool(torch.equal(rows, want)),
              netns=os.readlink("/proc/self/ns/net"), uname=socket.gethostname(),
              token=os.environ.get("PROBE_TOKEN"))
# One write per line: the launcher's pipe is shared with stderr noise.
sys.stdout.write("PROBE " + json.dumps(report) + "\n")
sys.stdout.flush()
hvd.shutdown()
