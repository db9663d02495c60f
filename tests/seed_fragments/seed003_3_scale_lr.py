# Seed fragment: ../shared/seeds/003_96f08bc267ccd6d9.txt, lines 29-30
# (the ALCF workshop page "PyTorch with Horovod",
# step 3 "Scale the learning rate").
# Between BEGIN and END: the user's lines, verbatim (less the code block's
# indentation). The rest is harness: what the fragment assumes its script
# already has, and the checks after it.
"""Step 3 of the ALCF page: scale the learning rate by hvd.size()."""
import horovod.torch as hvd
from fragment_harness import Net, check, done, parse_args

args = parse_args()
hvd.init()
model = Net()

# ---- BEGIN seed fragment (verbatim) ----
from torch import optim
optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
# ---- END seed fragment ----

check(optimizer.param_groups[0]["lr"] == args.lr * hvd.size(),
      "lr is not args.lr * hvd.size()")
check(optimizer.param_groups[0]["momentum"] == args.momentum, "momentum was not passed on")
done("003.3")
