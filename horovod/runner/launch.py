"""``python -m horovod.runner.launch ARGS`` is ``horovodrun ARGS``
(``horovod_torch.runner.launch``)."""
import sys

from horovod_torch.runner.launch import *  # noqa: F401,F403
from horovod_torch.runner.launch import main, parse_args, run_commandline  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
