"""What drives horovod_torch from other frameworks: Ray, Spark, Lightning, and the
torch.distributed backend "hvd" (torch_distributed)."""
