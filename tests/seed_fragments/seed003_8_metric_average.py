# Seed fragment: ../shared/seeds/003_96f08bc267ccd6d9.txt, lines 95-98
# (the ALCF workshop page "PyTorch with Horovod",
# step 8 "Average metrics across all workers").
# Between BEGIN and END: the user's lines, verbatim (less the code block's
# indentation). The rest is harness: what the fragment assumes its script
# already has, and the checks after it.
"""Step 8 of the ALCF page: average a metric over the workers (a 0-d tensor
allreduce, Average by default); WITH_HVD False keeps the local value."""
import torch

import horovod.torch as hvd
from fragment_harness import check, done

hvd.init()
WITH_HVD = True

# ---- BEGIN seed fragment (verbatim) ----
def tensor_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name) if WITH_HVD else tensor
    return avg_tensor.item()
# ---- END seed fragment ----

n = hvd.size()
check(abs(tensor_average(float(hvd.rank()), "avg_rank") - (n - 1) / 2) < 1e-6, "wrong average")
check(abs(tensor_average(0.25 * (hvd.rank() + 1), "avg_acc") - 0.125 * (n + 1)) < 1e-6,
      "wrong average")
WITH_HVD = False
check(tensor_average(float(hvd.rank()), "local") == float(hvd.rank()), "WITH_HVD=False reduced")
done("003.8")
