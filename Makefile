# meshrun: `make run` trains the main job, `make test` runs lint and the whole test suite.
# Both create .venv on first use: torch 2.13.0 (TORCH_SPEC; TORCH_INDEX picks the build, e.g.
# https://download.pytorch.org/whl/cpu or .../cu126), then meshrun in editable mode: `make run`
# with what the main job needs (its report's charts), `make test` adds the dev tools and every extra.

# The interpreter .venv is made from: Debian's python3.11 where it is there, with venv (statically
# linked, built with profile-guided and link-time optimisation; on this machine 1,177 of the suite's
# tests used ~6% less CPU on it than on `python3`, a pyenv build without them), else python3.
# `make PYTHON=/path/to/python3.x test` picks another (3.11 takes the torch 2.13.0 wheel on this disk).
PYTHON ?= $(shell /usr/bin/python3.11 -c "import ensurepip, venv" >/dev/null 2>&1 && echo /usr/bin/python3.11 || echo python3)
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.meshrun-installed
DEV_STAMP := $(VENV)/.meshrun-dev-installed
PYTEST_ARGS ?=
# The suite runs on 3 pytest-xdist workers on 2 cores, a whole file per worker (module fixtures
# share one run): with 2, one core idled ~150 s of a run while a worker waited (a hang bound, a
# node's rejoin); TEST_WORKERS=0 runs it in this process, one test after another. The tests
# marked `alone` run next, in one process: a Ray cluster shares 2 cores with nothing else (beside
# the rest of the suite its killed-worker job passed a 270 s bound it meets in ~70 s alone).
TEST_WORKERS ?= 3

.PHONY: run guide test setup lint bench clean

run: $(STAMP)  ## the main job on the embedded default: tiny Llama, built-in corpus, CPU, gloo, 2+ processes
	$(BIN)/meshrun train

guide: $(STAMP)  ## the guide's DDP example through meshrun launch
	$(BIN)/meshrun launch examples/guide/train_ddp.py --save runs/train_ddp/ckpt.pth

test: $(DEV_STAMP) lint  ## ruff, then every test (pytest exit 5, "no tests collected", is a failure)
	@$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile -m "not alone" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the suite is missing" >&2; rc=1; fi; \
	echo "== the tests marked alone (a local Ray cluster): after the others, with the cores to themselves (none selected: exit 5, fine)"; \
	$(BIN)/pytest -m alone $(PYTEST_ARGS); rc2=$$?; \
	if [ $$rc2 -eq 5 ]; then rc2=0; fi; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; exit $$rc2

lint: $(DEV_STAMP)
	$(BIN)/ruff check src tests examples benchmarks

setup: $(DEV_STAMP)

bench: $(DEV_STAMP)
	$(BIN)/python benchmarks/launch_overhead.py

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[report]'
	@touch $@

$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,report,hf,trackers,torchft,ray,lora]'
	@touch $@

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
