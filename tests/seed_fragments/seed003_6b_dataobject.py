# Seed fragment: ../shared/seeds/003_96f08bc267ccd6d9.txt, lines 70-76
# (the ALCF workshop page "PyTorch with Horovod",
# step 6, the DataObject dataclass).
# Between BEGIN and END: the user's lines, verbatim (less the code block's
# indentation). The rest is harness: what the fragment assumes its script
# already has, and the checks after it.
"""Step 6 of the ALCF page, second block: a dataclass grouping dataset, sampler and
loader. The harness fills one with a small dataset partitioned between ranks."""
import torch
import torch.utils.data.distributed

import horovod.torch as hvd
from fragment_harness import check, done

hvd.init()

# ---- BEGIN seed fragment (verbatim) ----
from dataclasses import dataclass

@dataclass
class DataObject:
    dataset: torch.utils.data.Dataset    # accessible via `DataObject.dataset`, etc.
    sampler: torch.utils.data.Sampler
    loader: torch.utils.data.DataLoader
# ---- END seed fragment ----

dataset = torch.utils.data.TensorDataset(torch.arange(10.0).unsqueeze(1))
sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=hvd.size(),
                                                          rank=hvd.rank(), shuffle=False)
train = DataObject(dataset=dataset, sampler=sampler,
                   loader=torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler))
check(train.dataset is dataset and train.sampler is sampler, "fields were not kept")
mine = [int(x) for (batch,) in train.loader for x in batch.flatten()]
everyone = hvd.allgather_object(mine)
check(sorted(sum(everyone, [])) == list(range(10)), f"loaders cover {everyone}")
done("003.6b")
