# Two commands do everything on a fresh machine: `make run` and `make test` (README, Quick start).
PY ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
RUN_DIR ?= runs/local
export AIRFLOW__CORE__LOAD_EXAMPLES ?= False
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: install run ui mlflow-ui test test-fast bench bench-quick lint clean

# The virtual environment, rebuilt when the dependency pins change.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# uv (pinned) downloads and installs in parallel: ~1 minute instead of pip's ~4. torch goes first through pip,
	# which takes a local CPU wheel where the machine has one (uv would download the multi-GB CUDA build).
	$(BIN)/pip install -q -c constraints.txt uv torch
	# Bytecode compiled now, not at each command's first import (uv does not by default; this machine sets
	# PYTHONDONTWRITEBYTECODE, so nothing was ever cached: `embshard place` spent ~4 s of ~15 compiling).
	$(BIN)/uv pip install --python $(BIN)/python -q --compile-bytecode -c constraints.txt -e ".[fbgemm-cpu,airflow,torchrec,dev]"
	# Consistent, except torchrec's metadata asking for the CUDA fbgemm-gpu (on a reinstall torchrec is present).
	$(BIN)/pip check > $(VENV)/pip-check.txt || ! grep -v "^torchrec [0-9.]* requires fbgemm-gpu," $(VENV)/pip-check.txt
	# torchrec without its metadata dependencies (they would pull the CUDA fbgemm-gpu); ours are in [torchrec].
	$(BIN)/uv pip install --python $(BIN)/python -q --compile-bytecode --no-deps -c constraints.txt torchrec==1.8.0
	# The project itself is installed editable (its sources are not compiled by the installer).
	$(BIN)/python -m compileall -q components dags
	@touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/embshard pipeline --out $(RUN_DIR)

# A real Airflow (api-server, scheduler, dag-processor, triggerer) on 127.0.0.1:$(PORT); prints the URL and login.
PORT ?= 8080
ui: install
	$(BIN)/embshard ui --out $(RUN_DIR) --port $(PORT)

# The MLflow store of $(RUN_DIR) (the one `make run` and `make ui` write to).
MLFLOW_PORT ?= 5000
mlflow-ui: install
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(abspath $(RUN_DIR))/mlflow.db --host 127.0.0.1 --port $(MLFLOW_PORT)

# Static checks (pinned in the dev extra): ruff, then mypy over the package and the DAGs.
lint: install
	$(BIN)/ruff check components dags benchmarks tests
	$(BIN)/mypy components/embshard dags

# The end-to-end runs (real Airflow, pipeline, harness) go in the background on the second core (tests/background.py).
test: install lint
	$(BIN)/python -m pytest -q --durations=15

# The edit loop: no lint, and without the tests marked slow (end-to-end runs, real Airflow).
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

bench: install
	$(BIN)/python -m benchmarks --suite all

bench-quick: install
	$(BIN)/python -m benchmarks --quick

clean:
	rm -rf $(VENV) runs .pytest_cache
