# The README's two commands: `make quickstart` and `make test`. Both create the
# environment first; nothing else is needed on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0
LOCK   := requirements/lock.txt
BENCH  := requirements/bench.txt
# A machine that already has torch (the GPU nodes) keeps it: the venv sees system packages.
HAS_TORCH := $(shell python3 -c "import torch" 2>/dev/null && echo yes)
# `make lock`: uv resolves against the CPU torch wheel found here (requirements/torch.txt).
TORCH_WHEELS ?= /opt/wheels
UV_VERSION   := 0.13.9

.PHONY: venv quickstart test test-quick test-faults test-latest test-exports gpu-check gpu-wheels lock lint docs clean

venv: $(VENV)/.installed

# Exactly the lock's versions (docs/reproducibility.md); a changed lock rebuilds from scratch.
$(VENV)/.installed: pyproject.toml $(LOCK) $(BENCH)
	rm -rf $(VENV)
ifeq ($(HAS_TORCH),yes)
	python3 -m venv --system-site-packages $(VENV)
else
	python3 -m venv $(VENV)
	# CPU wheel first, so that no dependency can pull a CUDA build of torch.
	$(PY) -m pip install -q "$(TORCH)"
endif
	$(PY) -m pip install -q -r $(LOCK)
	$(PY) -m pip install -q --no-deps -r $(BENCH)
	$(PY) -m pip install -q --no-deps -e .
	touch $@

quickstart: venv
	$(PY) pretrain/main.py --config configs/quickstart.yaml

# Two workers (pytest-xdist): one test at a time leaves a core idle half the time. A file's
# tests run on one worker, the Slurm files on one (tests/conftest.py, work_unit).
# TEST_WORKERS=0 runs them in this process (per-file times without two workers sharing cores).
TEST_WORKERS ?= 2
test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The inner loop (docs/reproducibility.md, "The suite's time"): model, data, config, planner,
# export and architecture unit tests and one short end-to-end training run (the golden run),
# about a minute on 2 cores; `make test` before a commit.
QUICK_TESTS := tests/test_architecture.py tests/test_model.py tests/test_model_rope.py \
	tests/test_model_attention_dispatch.py tests/test_model_documents.py \
	tests/test_model_stability.py tests/test_model_memory.py tests/test_model_info.py \
	tests/test_data_dataset.py tests/test_data_documents.py tests/test_tokenizer.py \
	tests/test_train_config.py tests/test_train_schedule.py tests/test_train_metrics_path.py \
	tests/test_train_golden.py tests/test_hf_parity.py tests/test_eval_metrics.py \
	tests/test_eval_position_plots.py
QUICK_PLAN := "not paper_plan and not cpu_allocator and not cli_plan and not choose_takes"
test-quick: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=5 $(QUICK_TESTS) "tests/test_plan.py" -k $(QUICK_PLAN)

# The training step in every setting it accepts against every numeric fault (the cells of
# tests/fault_matrix.py); `make test` runs a sample of them. Batches spread over the workers.
test-faults: venv
	PRETRAIN_FAULT_MATRIX=full $(PY) -m pytest -q -n $(TEST_WORKERS) --dist load tests/test_train_faults.py

# The GPU acceptance run (docs/gpu_check.md): the stages not done yet
# that fit in one 10-minute command; run it again until it says all done (exit 75 = stages
# left, not an error). GPU_CHECK_ARGS: e.g. --science, --stage kernels, --fresh, --cpu-smoke.
gpu-check: venv
	$(PY) tools/gpu_check.py $(GPU_CHECK_ARGS) || test $$? -eq 75

# For a GPU machine without a package index (its image has torch): the wheels gpu-check
# needs beyond the image, into .whl/ (docs/gpu_check.md, "A loan on these machines").
gpu-wheels: venv
	$(PY) requirements/envs.py offline-wheels

# The dependency-sensitive tests against the newest versions pyproject.toml's ranges allow
# (a fresh .venv-latest); a failure lists the packages that moved from the lock.
test-latest:
	python3 requirements/envs.py test-latest

# The export tests' transformers child in small environments (torch, transformers,
# safetensors) at both ends of the transformers range.
test-exports: venv
	python3 requirements/envs.py test-exports

# Regenerate the lock: the newest versions the ranges allow today, resolved by uv.
lock:
	python3 -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q "uv==$(UV_VERSION)"
	.venv-lock/bin/uv pip compile pyproject.toml --extra dev --upgrade \
		--python-version 3.11 --python-platform x86_64-unknown-linux-gnu \
		--find-links $(TORCH_WHEELS) --override requirements/torch.txt \
		--no-emit-package torch --no-emit-find-links --custom-compile-command "make lock" \
		-o $(LOCK)

# ruff, the import contracts (docs/architecture.md: import-linter's, in pyproject.toml, then
# the load-time and other rules of tests/contracts.py), then the
# generated files: schemas/*.json and docs/configuration.md's tables are the schema's
# (a stale one: one line naming it and `python tools/config_schema.py`, which rewrites them),
# then the files the docs and comments name (tests/stale_paths.py: one line per missing one).
lint: venv
	$(VENV)/bin/ruff check pretrain tools tests requirements
	$(VENV)/bin/ruff format --check pretrain tools tests requirements
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(PY) tests/contracts.py
	$(PY) tools/config_schema.py --check
	$(PY) tests/stale_paths.py

# The documentation site (mkdocs.yml, docs/) into site/: strict, so a broken link, anchor or
# missing page fails; the API pages are read from the docstrings without importing torch.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .venv-latest .venv-hf-oldest .venv-hf-newest .venv-lock runs/quickstart site
