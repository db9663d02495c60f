# Two commands for a newcomer (README.md):
#   make demo   set up, build, and run the elastic MNIST example on 2 local workers
#   make test   set up, build, and run the whole test suite (C++ and Python)
PYTHON ?= python3
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
NP ?= 2
DATA ?= data

.PHONY: setup build demo test pytest cpp-test bench clean

# System packages (apt, when missing), Python dependencies and the package's
# metadata/entry points (horovodrun), once.
.setup.stamp: setup.py requirements-dev.txt tools/system-deps.sh
	./tools/system-deps.sh
	$(PYTHON) -c "import torch, torchvision" 2>/dev/null || $(PYTHON) -m pip install $(TORCH_PINS)
	$(PYTHON) -m pip install -r requirements-dev.txt
	HOROVOD_TORCH_SKIP_EXT=1 $(PYTHON) -m pip install --no-build-isolation --no-deps -e .
	touch $@

setup: .setup.stamp

# The C++ extension, built in place and incrementally (ninja).
build: setup
	$(PYTHON) setup.py -q build_ext --inplace

EPOCHS ?= 3
SYNC_DIR ?= /tmp/horovod_torch_demo

demo: build
	$(PYTHON) -m horovod_torch.data mnist $(DATA)
	mkdir -p $(SYNC_DIR)
	OCI__SYNC_DIR=$(SYNC_DIR) horovodrun -np $(NP) --min-np 1 --max-np $(NP) \
	    --blacklist-cooldown-range 5 10 \
	    --host-discovery-script examples/elastic/discover_hosts.sh \
	    $(PYTHON) examples/elastic/train.py --data-dir $(DATA) --epochs $(EPOCHS)

cpp-test:
	$(MAKE) -C tests/cpp -j2 run

pytest: build
	$(PYTHON) -m pytest tests -q -rs -m "not gpu"

test: build cpp-test pytest

bench: build
	$(PYTHON) bench/allreduce_cpu.py

clean:
	rm -rf build tests/cpp/build horovod_torch/*.so .setup.stamp *.egg-info
