# zeroshard — the two commands a newcomer needs:
#   make demo   install what is missing, build, and pretrain tiny BART on 2 local ranks (DATA=your corpus: text or JSON lines, a directory or a file)
#   make test   install what is missing, build, and run the whole test suite (ctest)
# Other targets: make build, make bench, make clean, and
#   make install PREFIX=dir   the library, its headers, the tools, the CMake package and zeroshard.pc
#                             (then: find_package(zeroshard 0.2 CONFIG REQUIRED); docs/getting-started.md)
#   make deb                  zeroshard_<version>_amd64.deb, built against Debian's LibTorch (in build-system/)
# Variables:
#   TORCH=venv    (default) LibTorch 2.x: PyPI's torch wheel in the project's Python environment
#   TORCH=system  Debian's libtorch-dev 1.13, built in build-system/
#   TESTS=all     what make test runs: all, or a ctest label (default: all; core with TORCH=system)
#   ZS_NO_SKIP=1  (environment) every test must run: one that would skip (no root for the cluster) fails
#   BUILD_DIR, JOBS, VENV (where the Python environment lives)

TORCH ?= venv
VENV ?= $(CURDIR)/.venv
ifeq ($(TORCH),system)
BUILD_DIR ?= build-system
else
BUILD_DIR ?= build
endif
JOBS ?= 2
PREFIX ?= /usr/local
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release
# Against Debian's LibTorch no benchmark runs (make bench is the 2.x build's): not built.
ifeq ($(TORCH),system)
TORCH_FLAGS = -DZS_BUILD_BENCH=OFF
endif

.PHONY: all deps configure build install deb test demo bench clean

all: build

deps:
	@scripts/install-deps.sh $(VENV) $(TORCH)

# Ninja for a new build directory (it schedules every target's files at once; an
# existing directory keeps the generator it was made with).
GENERATOR = $(if $(wildcard $(BUILD_DIR)/CMakeCache.txt),,-G Ninja)

configure: deps
	@cmake -S . -B $(BUILD_DIR) $(GENERATOR) -DZS_TORCH=$(TORCH) -DZS_PYTHON=$(VENV)/bin/python $(TORCH_FLAGS) $(CMAKE_FLAGS) \
	  > $(BUILD_DIR).configure.log 2>&1 || { cat $(BUILD_DIR).configure.log; exit 1; }
	@grep "^-- zeroshard" $(BUILD_DIR).configure.log || true

build: configure
	@cmake --build $(BUILD_DIR) -j$(JOBS)

# What a trainer links (the libraries and the tools), then installed under PREFIX.
install: configure
	@cmake --build $(BUILD_DIR) -j$(JOBS) --target zeroshard zeroshard_checkpoint zeroshard_replica zeroshard-run zeroshard-ckpt zeroshard-plan
	@cmake --install $(BUILD_DIR) --prefix $(PREFIX)

# The Debian package: against Debian's LibTorch only (a .deb cannot depend on a Python environment).
ifeq ($(TORCH),system)
deb: configure
	@cmake --build $(BUILD_DIR) -j$(JOBS) --target zeroshard zeroshard_checkpoint zeroshard_replica zeroshard-run zeroshard-ckpt zeroshard-plan
	@cd $(BUILD_DIR) && cpack -G DEB
else
deb:
	@$(MAKE) --no-print-directory deb TORCH=system
endif

# Which tests `make test` runs: all of them, or a ctest label. Against Debian's LibTorch 1.13
# (TORCH=system) the default is the label "core": the unit tests and the oracle, checkpoint
# and pipeline tests at 1 and 2 ranks, which exercise src/compat (the seam between the
# LibTorch versions); everything else runs against 2.x. TESTS=all runs all of them.
ifeq ($(TORCH),system)
TESTS ?= core
else
TESTS ?= all
endif

# JOBS tests at a time: each test process computes on one thread (tests/CMakeLists.txt), and
# many wait on sockets, timeouts and subprocesses, so two at a time fill 2 cores.
# At the end: why each failed test failed, and one line for each test that did not run and why
# (scripts/test-skips.py). ZS_NO_SKIP=1 (.ci/run) makes a test that would skip fail instead.
test: build
	@cd $(BUILD_DIR) && rm -f ctest-junit.xml && \
	  { ctest --output-on-failure --output-junit ctest-junit.xml --test-output-size-passed 8388608 --timeout 600 -j$(JOBS) \
	      $(if $(filter all,$(TESTS)),,-L $(TESTS)) || { $(CURDIR)/scripts/test-failures.sh .; failed=1; }; \
	    $(VENV)/bin/python $(CURDIR)/scripts/test-skips.py ctest-junit.xml || failed=1; \
	    [ -z "$$failed" ]; }

# The demo builds only what it runs (the launcher, the trainer, the checkpoint tool).
demo: configure
	@cmake --build $(BUILD_DIR) -j$(JOBS) --target zeroshard-run bart_pretrain zeroshard-ckpt
	@scripts/demo.sh $(BUILD_DIR)

bench: build
	@$(BUILD_DIR)/zeroshard-run --nproc-per-node 2 -- $(BUILD_DIR)/bench/comm_bench
	@$(BUILD_DIR)/zeroshard-run --nproc-per-node 4 -- $(BUILD_DIR)/bench/comm_bench
	@PYTHON=$(VENV)/bin/python bench/comm_vs_gloo.sh $(BUILD_DIR) 4 2
	@bench/cluster_comm_bench.sh $(BUILD_DIR) 4 2 1gbit || [ $$? -eq 77 ]  # needs root: 77 = the hosts cannot be made
	@PYTHON=$(VENV)/bin/python bench/cluster_bart_bench.sh $(BUILD_DIR) 2 2 1gbit small 12 || [ $$? -eq 77 ]
	@PYTHON=$(VENV)/bin/python bench/gather_loss.sh $(BUILD_DIR) small 300 4 3e-4  # at 1e-3 it sits on a plateau
	@PYTHON=$(VENV)/bin/python bench/memory_wall.sh $(BUILD_DIR) 4 3G large || [ $$? -eq 77 ]  # needs root (cgroups)
	@PYTHON=$(VENV)/bin/python bench/plan_validate.sh $(BUILD_DIR) 200mbit "2 3 4" || [ $$? -eq 77 ]  # needs root
	@bench/plan_table.sh $(BUILD_DIR)
	@PYTHON=$(VENV)/bin/python bench/optim_bench.sh $(BUILD_DIR) "1 2"
	@PYTHON=$(VENV)/bin/python bench/zero_vs_ddp.sh $(BUILD_DIR) 4
	@PYTHON=$(VENV)/bin/python bench/zero3_bench.sh $(BUILD_DIR) 4
	@PYTHON=$(VENV)/bin/python bench/ckpt_bench.sh $(BUILD_DIR) 4 --repeats 3
	@PYTHON=$(VENV)/bin/python bench/durable_bench.sh $(BUILD_DIR) 2 --layers 10 --repeats 3
	@bench/ckpt_resume.py $(BUILD_DIR)
	@$(VENV)/bin/python bench/fault_bench.py $(BUILD_DIR)  # SIGKILLs: the restart path, replica groups, torchft
	@$(VENV)/bin/python bench/heal_bench.py $(BUILD_DIR) || [ $$? -eq 77 ]  # needs root: a heal over tc-shaped links
	@bench/bart_bench.sh $(BUILD_DIR) 4
	@bench/pipe_bench.sh $(BUILD_DIR)
	@bench/bart_pipe_bench.sh $(BUILD_DIR) 2
	@bench/bart_pipe_bench.sh $(BUILD_DIR) 4
	@PYTHON=$(VENV)/bin/python bench/demo_bench.sh $(BUILD_DIR)  # make demo as shipped: the README's accuracies
	@bench/watch_bench.sh $(BUILD_DIR) 2  # TensorBoard and every rank's figures: their cost per step
	@bench/denormal_bench.sh $(BUILD_DIR) 1500
	@PYTHON=$(VENV)/bin/python bench/strategies.sh $(BUILD_DIR)

clean:
	rm -rf $(BUILD_DIR) $(BUILD_DIR).configure.log
