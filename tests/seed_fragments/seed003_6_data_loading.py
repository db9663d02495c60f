# Seed fragment: ../shared/seeds/003_96f08bc267ccd6d9.txt, lines 53-64
# (the ALCF workshop page "PyTorch with Horovod",
# step 6 "Loading data according to the rank ID").
# Between BEGIN and END: the user's lines, verbatim (less the code block's
# indentation). The rest is harness: what the fragment assumes its script
# already has, and the checks after it.
"""Step 6 of the ALCF page: MNIST from 'datasets/' (relative to the working directory,
where the test writes offline MNIST-format files with `python -m horovod_torch.data
mnist datasets`), partitioned between ranks by a DistributedSampler."""
import torch.utils.data.distributed
from torchvision import datasets, transforms

import horovod.torch as hvd
from fragment_harness import Net, check, done, parse_args, same_on_every_rank

args = parse_args()
hvd.init()
kwargs = {}

# ---- BEGIN seed fragment (verbatim) ----
transform = transforms.Compose([
    transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))
])
train_dataset = datasets.MNIST('datasets/', train=True, download=True, transform=transform)
train_sampler = torch.utils.data.distributed.DistributedSampler(
    train_dataset,
    num_replicas=hvd.size(),
    rank=hvd.rank()
)
train_loader = torch.utils.data.DataLoader(
	train_dataset, batch_size=args.batch_size, sampler=train_sampler, **kwargs
)
# ---- END seed fragment ----

n = len(train_dataset)
check(len(train_sampler) == -(-n // hvd.size()), f"sampler has {len(train_sampler)} of {n}")
shards = hvd.allgather_object(list(train_sampler))
check(sorted(set(i for s in shards for i in s)) == list(range(n)), "shards do not cover the data")
check(n % hvd.size() or sum(map(len, shards)) == n, "ranks got the same samples")
data, target = next(iter(train_loader))
check(tuple(data.shape) == (args.batch_size, 1, 28, 28) and target.dtype == torch.int64,
      f"batch of shape {tuple(data.shape)}")
model = Net()
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
model.train()
for step, (data, target) in enumerate(train_loader):
    optimizer.zero_grad()
    torch.nn.functional.nll_loss(model(data), target).backward()
    optimizer.step()
    if step == 4:
        break
check(same_on_every_rank(model.parameters(), "weights"), "ranks diverged while training")
done("003.6")
