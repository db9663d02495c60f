# Seed fragment: ../shared/seeds/003_96f08bc267ccd6d9.txt, lines 44-45
# (the ALCF workshop page "PyTorch with Horovod",
# step 5 "Broadcast the model from rank 0").
# Between BEGIN and END: the user's lines, verbatim (less the code block's
# indentation). The rest is harness: what the fragment assumes its script
# already has, and the checks after it.
"""Step 5 of the ALCF page: start every rank from rank 0's model and optimizer state.
The harness makes them differ first: another initialisation, learning rate and
momentum buffer on every rank."""
from torch import optim

import horovod.torch as hvd
from fragment_harness import (check, done, model_for_this_rank, parse_args, same_on_every_rank,
                              train)

args = parse_args()
hvd.init()
model = model_for_this_rank()
local = optim.SGD(model.parameters(), lr=args.lr * (hvd.rank() + 1), momentum=args.momentum)
train(model, local, steps=1)  # a local step: momentum buffers differ between ranks
optimizer = hvd.DistributedOptimizer(local, named_parameters=model.named_parameters())

# ---- BEGIN seed fragment (verbatim) ----
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
# ---- END seed fragment ----

check(same_on_every_rank(model.parameters(), "weights"), "parameters differ after the broadcast")
check(optimizer.param_groups[0]["lr"] == args.lr, "lr is not rank 0's")
buffers = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
check(same_on_every_rank(buffers, "momentum"), "momentum buffers differ after the broadcast")
train(model, optimizer, steps=2)
check(same_on_every_rank(model.parameters(), "trained"), "ranks diverged while training")
done("003.5")
