"""Entry point of a test worker: `python -m tests.run_worker module:function args...`."""
import importlib
import sys


def main() -> None:
    module_name, func_name = sys.argv[1].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    func(*sys.argv[2:])


if __name__ == "__main__":
    main()
