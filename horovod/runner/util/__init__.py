"""``horovod.runner.util``: see ``horovod_torch.runner.util``."""
