"""Makes ``dist.init_process_group("hvd")`` work in a script that never imports
horovod_torch: a DDP or FSDP2 script that takes its backend's name from a flag or the
environment runs on the engine unchanged.

torch calls :func:`register` when it is imported, through the ``torch.backends`` entry
point of this package's metadata (torch's mechanism for out-of-tree backends; off with
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). It only adds the name: the backend's module, the
extension and the engine load when a group of "hvd" is first created. Importing
horovod_torch.integrations.torch_distributed (or any of the API) registers it too.

Runs inside ``import torch``: it must stay cheap and must never raise, since torch
turns an entry point's exception into a failed import of torch.
"""


def register() -> None:
    """Registers "hvd" with torch.distributed for CPU and CUDA tensors, as
    torch_distributed.register() does but without loading that module (a later call of
    either does nothing). Never raises: without torch.distributed there is no backend."""
    try:
        import torch.distributed as dist

        if dist.is_available() and not hasattr(dist.Backend, "HVD"):
            dist.Backend.register_backend("hvd", _create, extended_api=True,
                                          devices=["cpu", "cuda"])
    except Exception:  # noqa: BLE001  (inside `import torch`, raising would fail it)
        pass


def _create(opts, backend_options):
    """torch.distributed calls this on each rank of a new "hvd" group."""
    from horovod_torch.integrations import torch_distributed

    return torch_distributed._create(opts, backend_options)
