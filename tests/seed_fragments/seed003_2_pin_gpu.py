# Seed fragment: ../shared/seeds/003_96f08bc267ccd6d9.txt, lines 21-21
# (the ALCF workshop page "PyTorch with Horovod",
# step 2 "Assign GPUs to each rank").
# Between BEGIN and END: the user's lines, verbatim (less the code block's
# indentation). The rest is harness: what the fragment assumes its script
# already has, and the checks after it.
"""Step 2 of the ALCF page: one GPU per process, chosen by local rank. Needs a GPU per
local rank (the test carries the `gpu` marker)."""
import torch

import horovod.torch as hvd
from fragment_harness import check, done

hvd.init()

# ---- BEGIN seed fragment (verbatim) ----
torch.cuda.set_device(hvd.local_rank())
# ---- END seed fragment ----

check(torch.cuda.current_device() == hvd.local_rank(), "not pinned to the local rank's GPU")
out = hvd.allreduce(torch.full((4,), float(hvd.rank()), device="cuda"), op=hvd.Sum,
                    name="on_gpu")
check(out.is_cuda and out.cpu().tolist() == [float(sum(range(hvd.size())))] * 4,
      f"GPU allreduce gave {out}")
done("003.2")
