# Two commands for a newcomer (README.md):
#   make demo   set up, build, and run the elastic MNIST example on 2 local workers,
#               killing one mid-training and letting a new one join (make demo-plain:
#               no kill)
#   make test   set up, build, and run the whole test suite (C++ and Python)
#   make test-fast  the C++ tests and one Python test per area (a few minutes)
#
# Everything Python goes into the project's virtual environment $(VENV); the system
# Python is only used to create it. Set-up output goes to $(LOG), one line per stage
# on the terminal (VERBOSE=1 shows it all).
VENV ?= .venv
BOOTSTRAP_PYTHON ?= python3
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
NP ?= 2
DATA ?= data
LOG ?= .setup.log

PYTHON := $(abspath $(VENV))/bin/python
BUILD_STAMP := $(VENV)/.build.stamp
STAMP := $(VENV)/.setup.stamp
STAGE := ./tools/stage.sh $(LOG)
# horovodrun, pytest and python resolve to the virtual environment's.
export PATH := $(abspath $(VENV))/bin:$(PATH)
export VIRTUAL_ENV := $(abspath $(VENV))

.PHONY: setup setup-build build demo demo-plain test test-fast pytest cpp-test cpp-check bench clean distclean

# What building and the demo need, once: the compiler (apt, when missing), the virtual
# environment, torch, the build tools (setuptools, ninja) and the package in editable
# mode with its dependencies and its examples' (the [examples] extra; horovodrun).
$(BUILD_STAMP): setup.py pyproject.toml tools/system-deps.sh
	@: > $(LOG)
	@$(STAGE) "system packages for the build (apt, only what is missing)" ./tools/system-deps.sh build
	@$(STAGE) "virtual environment $(VENV)" $(BOOTSTRAP_PYTHON) -m venv $(VENV)
	@$(STAGE) "torch and torchvision (about 3 min the first time)" sh -c \
	    '$(PYTHON) -c "import torch, torchvision" 2>/dev/null || $(PYTHON) -m pip install $(TORCH_PINS)'
	@$(STAGE) "build tools (setuptools, ninja)" $(PYTHON) -m pip install "setuptools>=77" ninja
	@$(STAGE) "horovod_torch package and horovodrun (editable), with the examples' dependencies" \
	    env HOROVOD_TORCH_SKIP_EXT=1 $(PYTHON) -m pip install --no-build-isolation -e ".[examples]"
	@touch $@

# What the tests add, once: the other apt packages (clang, GoogleTest, OpenMPI, sshd, a
# Java runtime) and the Python test dependencies (every extra among them).
# An extension built before (make demo) lacks OpenMPI when apt has just installed it:
# it is removed, so that the next build links it in (the objects stay: it relinks).
$(STAMP): $(BUILD_STAMP) requirements-dev.txt tools/system-deps.sh
	@$(STAGE) "system packages for the tests (apt, only what is missing)" ./tools/system-deps.sh test
	@$(STAGE) "test dependencies" $(PYTHON) -m pip install -r requirements-dev.txt
	@if command -v mpicxx >/dev/null && ls horovod_torch/_C*.so >/dev/null 2>&1 && \
	    ! $(PYTHON) -c "import sys, torch, horovod_torch._C as c; sys.exit(0 if c.mpi_built() else 1)" 2>/dev/null; then \
	  rm -f horovod_torch/_C*.so; echo "the extension will be rebuilt with MPI"; fi
	@touch $@

setup-build: $(BUILD_STAMP)
setup: $(STAMP)

# The C++ extension, built in place and incrementally (ninja).
build: setup-build
	@$(STAGE) "C++ extension horovod_torch._C (about 3 min on 2 cores the first time)" \
	    $(PYTHON) setup.py build_ext --inplace

SYNC_DIR ?= /tmp/horovod_torch_demo
DEMO = $(PYTHON) examples/elastic/demo.py --np $(NP) --data-dir $(DATA) --sync-dir $(SYNC_DIR)

demo: build
	$(DEMO)

demo-plain: build
	$(DEMO) --no-fault

# The torch-free tests, then the Runtime's (linked against the virtual environment's
# libtorch).
cpp-test: setup
	@$(STAGE) "C++ tests: build (about 2 min on 2 cores the first time)" \
	    $(MAKE) -C tests/cpp -j2 all runtime PYTHON=$(PYTHON)
	$(MAKE) -C tests/cpp run
	$(MAKE) -C tests/cpp runtime-run PYTHON=$(PYTHON)

# The C++ style (.clang-format) and Clang's thread-safety analysis of the lock
# annotations (csrc/common/thread_annotations.h).
cpp-check: setup
	@$(STAGE) "C++ style checked by clang-format" ./tools/check_format.sh
	@$(STAGE) "C++ lock annotations checked by clang -Wthread-safety (about 1 min)" \
	    ./tools/check_thread_safety.sh $(PYTHON)

pytest: setup build
	$(PYTHON) -m pytest tests -q -rs -m "not gpu"

# setup before build: the tests' apt packages (OpenMPI) are then there to be built in.
test: setup build cpp-test cpp-check pytest

test-fast: setup build cpp-test
	$(PYTHON) -m pytest -q -rs $$(grep -v '^#' tests/fast.txt)

bench: build
	$(PYTHON) bench/allreduce_cpu.py

clean:
	rm -rf build tests/cpp/build horovod_torch/*.so horovod_torch/_build_info.py *.egg-info $(STAMP) $(BUILD_STAMP)

distclean: clean
	rm -rf $(VENV) $(LOG)
