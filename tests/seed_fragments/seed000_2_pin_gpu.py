# Seed fragment: ../shared/seeds/000_52b4d2bf3dde7fdb.txt, lines 100-104
# (the OCI Data Science guide "Writing Distributed code with Horovod Framework",
# PyTorch step 2 "Pin each GPU to a single process").
# Between BEGIN and END: the user's lines, verbatim (less the code block's
# indentation). The rest is harness: what the fragment assumes its script
# already has, and the checks after it.
"""Step 2 of the OCI guide: seed, and pin this process to the GPU of its local rank
when CUDA is used (--no-cuda, or no GPU: only the seed)."""
import torch

import horovod.torch as hvd
from fragment_harness import check, done, parse_args

args = parse_args()
hvd.init()

# ---- BEGIN seed fragment (verbatim) ----
torch.manual_seed(args.seed)
if args.cuda:
  # Horovod: pin GPU to local rank.
  torch.cuda.set_device(hvd.local_rank())
  torch.cuda.manual_seed(args.seed)
# ---- END seed fragment ----

check(torch.initial_seed() == args.seed, "torch.manual_seed(args.seed) did not take")
check(args.cuda == args.expect_cuda, f"args.cuda is {args.cuda}")
if args.cuda:
    check(torch.cuda.current_device() == hvd.local_rank(), "not pinned to the local rank's GPU")
    out = hvd.allreduce(torch.ones(4, device="cuda"), op=hvd.Sum, name="on_gpu")
    check(out.is_cuda and out.cpu().tolist() == [float(hvd.size())] * 4,
          f"GPU allreduce gave {out}")
done("000.2")
