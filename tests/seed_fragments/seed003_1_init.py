# Seed fragment: ../shared/seeds/003_96f08bc267ccd6d9.txt, lines 12-13
# (the ALCF workshop page "PyTorch with Horovod",
# step 1 "Initialize Horovod").
# Between BEGIN and END: the user's lines, verbatim (less the code block's
# indentation). The rest is harness: what the fragment assumes its script
# already has, and the checks after it.
"""Step 1 of the ALCF page: import horovod.torch and initialise it."""
import os

import torch

from fragment_harness import check, done

# ---- BEGIN seed fragment (verbatim) ----
import horovod.torch as hvd
hvd.init()
# ---- END seed fragment ----

check(hvd.is_initialized(), "hvd.init() did not initialise Horovod")
check((hvd.rank(), hvd.size()) == (int(os.environ["HOROVOD_RANK"]),
                                   int(os.environ["HOROVOD_SIZE"])),
      "rank/size differ from horovodrun's")
check(hvd.local_rank() == int(os.environ["HOROVOD_LOCAL_RANK"]), "wrong local_rank")
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="ranks")
check(total.item() == sum(range(hvd.size())), f"allreduce gave {total}")
done("003.1")
