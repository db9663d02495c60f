# Seed fragment: ../shared/seeds/000_52b4d2bf3dde7fdb.txt, lines 122-127
# (the OCI Data Science guide "Writing Distributed code with Horovod Framework",
# PyTorch step 4 "Wrap the optimizer in hvd.DistributedOptimizer").
# Between BEGIN and END: the user's lines, verbatim (less the code block's
# indentation). The rest is harness: what the fragment assumes its script
# already has, and the checks after it.
"""Step 4 of the OCI guide: wrap the optimizer, averaging gradients or combining them
with Adasum (--use-adasum); optional fp16 compression (--fp16-allreduce). The harness
then trains a few steps on different data per rank: the models must stay identical."""
import torch.optim as optim

import horovod.torch as hvd
from fragment_harness import (check, done, model_for_this_rank, parse_args, same_on_every_rank,
                              train)

args = parse_args()
hvd.init()
model = model_for_this_rank()
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
lr_scaler = hvd.size() if not args.use_adasum else 1
optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# ---- BEGIN seed fragment (verbatim) ----
optimizer = hvd.DistributedOptimizer(
  optimizer,
  named_parameters=model.named_parameters(),
  compression=compression,
  op=hvd.Adasum if args.use_adasum else hvd.Average
)
# ---- END seed fragment ----

check(isinstance(optimizer, optim.SGD), "the wrapped optimizer is no longer an SGD")
names = sorted(n for n, _ in model.named_parameters())
check(sorted(optimizer._parameter_names.values()) == names,
      "parameter names were not taken from model.named_parameters()")
before = [p.detach().clone() for p in model.parameters()]
train(model, optimizer, steps=3)
check(any(not p.equal(b) for p, b in zip(model.parameters(), before)), "training changed nothing")
check(same_on_every_rank(model.parameters(), "weights"), "ranks ended with different weights")
done("000.4")
