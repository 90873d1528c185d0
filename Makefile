# The two commands of the README: `make serve` and `make test`. Both create/update .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test test-slow lint install clean mutate docker-check browser

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/hkserve serve

# Two pytest-xdist workers (one per core of the CI machine); a test file stays on one worker. The files
# are queued longest first (tests/conftest.py, tests/file_seconds.json), not by xdist's test counts.
TEST_WORKERS ?= 2
TEST_ORDER := --dist loadfile --no-loadscope-reorder

# The chat page's tests (tests/test_web_page.py) drive Debian's Chromium through selenium: installed
# here when missing (as root, from Debian's archive; no downloaded browser builds).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver; }

test: $(STAMP) lint browser
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(TEST_ORDER) --durations=15

# The long checks kept out of `make test` (@pytest.mark.slow; docs/testing.md lists them).
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow -n $(TEST_WORKERS) $(TEST_ORDER) --durations=15

# Code shape: ruff (lint + format) and the import layers of pyproject.toml (import-linter).
lint: $(STAMP)
	$(BIN)/ruff check hkserve tests scripts deploy
	$(BIN)/ruff format --check hkserve tests scripts deploy
	$(BIN)/lint-imports --no-cache

# Mutation testing ([tool.mutmut] in pyproject.toml; docs/testing.md): slow, not part of `make test`.
# A part only: make mutate MUTANTS='hkserve.model.sampling.* hkserve.engine.textstream.*'
MUTATE_STAMP := $(VENV)/.installed-mutate

$(MUTATE_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,mutate]'
	touch $(MUTATE_STAMP)

mutate: $(MUTATE_STAMP)
	$(BIN)/mutmut run $(MUTANTS)
	$(BIN)/python tests/mutation_scores.py

# The image built with buildah on a locally made Debian base, served from and stopped (root, minutes;
# docs/deploy.md). Not part of `make test`. DOCKER_CHECK_CLEAN=1: from no images; DOCKER_CHECK_CUDA=1:
# also build the CUDA variant.
docker-check: $(STAMP)
	nice -n 5 scripts/docker-check.sh

clean:
	rm -rf $(VENV) *.egg-info mutants .docker-check
