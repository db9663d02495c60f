"""Allow ``python -m horovod_torch.runner`` as an alias of ``horovodrun``."""
import sys

from horovod_torch.runner.launch import main

if __name__ == "__main__":
    sys.exit(main())
