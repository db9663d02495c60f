# Seed fragment: ../shared/seeds/000_52b4d2bf3dde7fdb.txt, lines 91-92
# (the OCI Data Science guide "Writing Distributed code with Horovod Framework",
# PyTorch step 1 "Import Horovod and initialize it").
# Between BEGIN and END: the user's lines, verbatim (less the code block's
# indentation). The rest is harness: what the fragment assumes its script
# already has, and the checks after it.
"""Step 1 of the OCI guide: import horovod.torch and initialise it."""
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
check(0 <= hvd.local_rank() < hvd.local_size(), "local_rank out of range")
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="ranks")
check(total.item() == sum(range(hvd.size())), f"allreduce gave {total}")
done("000.1")
