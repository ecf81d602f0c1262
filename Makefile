# meshrun: `make run` trains the main job, `make test` runs lint and the whole test suite.
# Both create .venv on first use: torch 2.13.0 (the CPU build from the local wheel here;
# set TORCH_SPEC to choose another build), then meshrun in editable mode with its dev tools.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.meshrun-installed
PYTEST_ARGS ?=
# The suite runs on 2 pytest-xdist workers, a whole file per worker (module fixtures share one
# run); TEST_WORKERS=0 runs it in this process, one test after another.
TEST_WORKERS ?= 2

.PHONY: run guide test setup lint bench clean

run: $(STAMP)  ## the main job on the embedded default: tiny Llama, built-in corpus, CPU, gloo, 2+ processes
	$(BIN)/meshrun train

guide: $(STAMP)  ## the guide's DDP example through meshrun launch
	$(BIN)/meshrun launch examples/guide/train_ddp.py --save runs/train_ddp/ckpt.pth

test: $(STAMP) lint  ## ruff, then every test (pytest exit 5, "no tests collected", is a failure)
	@$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the suite is missing" >&2; exit 1; fi; \
	exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks

setup: $(STAMP)

bench: $(STAMP)
	$(BIN)/python benchmarks/launch_overhead.py

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,report,hf,trackers,torchft]'
	@touch $@

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
