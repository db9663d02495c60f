"""A torch.distributed script that never imports horovod_torch: torch's entry point
(horovod_torch/integrations/c10d_autoload.py) registers "hvd" when torch is imported."""
import sys

import torch
import torch.distributed as dist


def plain_script():
    # Registering loads neither the backend's module nor the extension.
    heavy = ("horovod_torch.integrations.torch_distributed", "horovod_torch._C")
    loaded_early = [m for m in heavy if m in sys.modules]
    dist.init_process_group("hvd")
    r = dist.get_rank()
    t = torch.full((4,), float(r + 1))
    dist.all_reduce(t)
    print(f"PLAIN rank={r} backend={dist.get_backend()} sum={t[0].item()} "
          f"engine={'horovod_torch._C' in sys.modules} before_init={loaded_early}", flush=True)
    dist.destroy_process_group()
