# Seed fragment: ../shared/seeds/000_52b4d2bf3dde7fdb.txt, lines 112-113
# (the OCI Data Science guide "Writing Distributed code with Horovod Framework",
# PyTorch step 3 "Scale the learning rate by the number of workers").
# Between BEGIN and END: the user's lines, verbatim (less the code block's
# indentation). The rest is harness: what the fragment assumes its script
# already has, and the checks after it.
"""Step 3 of the OCI guide: scale the learning rate by hvd.size()."""
import torch.optim as optim  # as the guide's train.py imports it

import horovod.torch as hvd
from fragment_harness import Net, check, done, parse_args

args = parse_args()
hvd.init()
model = Net()

# ---- BEGIN seed fragment (verbatim) ----
optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                    momentum=args.momentum)
# ---- END seed fragment ----

check(optimizer.param_groups[0]["lr"] == args.lr * hvd.size(),
      "lr is not args.lr * hvd.size()")
check(optimizer.param_groups[0]["momentum"] == args.momentum, "momentum was not passed on")
done("000.3")
