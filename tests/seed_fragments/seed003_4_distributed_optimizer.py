# Seed fragment: ../shared/seeds/003_96f08bc267ccd6d9.txt, lines 36-36
# (the ALCF workshop page "PyTorch with Horovod",
# step 4 "Wrap the optimizer with hvd.DistributedOptimizer").
# Between BEGIN and END: the user's lines, verbatim (less the code block's
# indentation). The rest is harness: what the fragment assumes its script
# already has, and the checks after it.
"""Step 4 of the ALCF page: wrap the optimizer (fp16 compression with
--fp16-allreduce). The harness then trains a few steps on different data per rank:
the models must stay identical."""
from torch import optim

import horovod.torch as hvd
from fragment_harness import (check, done, model_for_this_rank, parse_args, same_on_every_rank,
                              train)

args = parse_args()
hvd.init()
model = model_for_this_rank()
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# ---- BEGIN seed fragment (verbatim) ----
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression)
# ---- END seed fragment ----

check(isinstance(optimizer, optim.SGD), "the wrapped optimizer is no longer an SGD")
train(model, optimizer, steps=3)
check(same_on_every_rank(model.parameters(), "weights"), "ranks ended with different weights")
done("003.4")
