"""The ``horovodrun`` launcher for horovod_torch.

Kept deliberately import-light: nothing here loads torch or the C++
extension, so ``horovodrun --help`` and argument errors stay fast.
"""
