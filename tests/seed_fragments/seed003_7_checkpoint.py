# Seed fragment: ../shared/seeds/003_96f08bc267ccd6d9.txt, lines 86-87
# (the ALCF workshop page "PyTorch with Horovod",
# step 7 "Checkpointing _only_ from root rank").
# Between BEGIN and END: the user's lines, verbatim (less the code block's
# indentation). The rest is harness: what the fragment assumes its script
# already has, and the checks after it.
"""Step 7 of the ALCF page: only rank 0 writes the checkpoint. `checkpoint` is a
minimal stand-in for the guide's checkpoint object (save(directory)); `checkpoint_dir`
is the directory the test passes with --out-dir, the same for every rank."""
import os

import torch

import horovod.torch as hvd
from fragment_harness import Net, check, done, parse_args

args = parse_args()
hvd.init()
model = Net()


class Checkpoint:
    def __init__(self, **objects):
        self.objects = objects

    def save(self, directory):
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "checkpoint-1.pt")
        torch.save({"rank": hvd.rank(), **{k: v.state_dict() for k, v in self.objects.items()}},
                   path)
        return path


checkpoint = Checkpoint(model=model)
checkpoint_dir = os.path.join(args.out_dir, "ckpt_dir")

# ---- BEGIN seed fragment (verbatim) ----
if hvd.rank() == 0:
    checkpoint.save(checkpoint_dir)
# ---- END seed fragment ----

hvd.barrier()  # rank 0 has written
files = sorted(os.listdir(checkpoint_dir)) if os.path.isdir(checkpoint_dir) else []
check(files == ["checkpoint-1.pt"], f"checkpoint files: {files}")
saved = torch.load(os.path.join(checkpoint_dir, files[0]))
check(saved["rank"] == 0 and set(saved["model"]) == set(model.state_dict()), "not rank 0's save")
done("003.7")
