"""The ``horovodrun`` launcher for horovod_torch, and ``run(func, ...)``
(``horovod.runner.run``), which runs a function on every worker of a job.

Kept deliberately import-light: nothing here loads torch or the C++
extension, so ``horovodrun --help`` and argument errors stay fast.
"""


def __getattr__(name):
    # Looked up on first use: importing it here would import .launch with the
    # package, before ``python -m horovod_torch.runner.launch`` runs it.
    if name == "run":
        from horovod_torch.runner.func import run  # pylint: disable=import-outside-toplevel
        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
