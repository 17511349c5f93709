# Every target sets up .venv itself from a fresh clone.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_WHEEL_DIR ?= /opt/wheels
# DeepSpeed ships only a source build that imports torch: built against the CPU torch
# above (--no-build-isolation), never against a torch pip would fetch for the build.
DEEPSPEED_VERSION ?= 0.19.8

.PHONY: promtool dashboard goodput venv demo test test-fast test-gpu test-slow test-frameworks faults fuzz model-check soak bench bench-deps proto lint typecheck clean

venv: $(STAMP)

# torch (the test extra names it, for the DCP tests) is installed first, always a CPU
# build (see install_torch_cpu), so pip finds it satisfied and never fetches PyPI's.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(install_torch_cpu)
	$(PY) -m pip install -q --no-build-isolation deepspeed==$(DEEPSPEED_VERSION)
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

demo: venv
	$(VENV)/bin/ckptd demo

# promtool (for the alert-rule tests) from Debian's prometheus package, unpacked into
# .venv/bin: no service installed, nothing outside the venv. Best effort: without it
# (no apt, no registry) those tests skip and say why.
promtool: $(VENV)/bin/promtool
$(VENV)/bin/promtool: | venv
	@tmp=$$(mktemp -d) && cd $$tmp && \
	if apt-get download -q prometheus >/dev/null 2>&1 && dpkg-deb -x prometheus_*.deb x; then \
		cp x/usr/bin/promtool x/usr/bin/prometheus $(CURDIR)/$(VENV)/bin/ && \
		echo "promtool and prometheus installed in $(VENV)/bin"; \
	else echo "promtool unavailable (apt-get download prometheus failed): its tests will skip"; fi; \
	rm -rf $$tmp

# The full fault-injection suite is `make faults`, the full gRPC fuzz run `make fuzz`, the
# long model-checker run `make model-check`; `make test` runs a representative subset of the
# first, a 200-case sample of the second and a few sequences of the third.
test: venv promtool
	$(PY) -m pytest -q -m "not faults and not fuzz and not frameworks and not model" tests

# The unit tier (tests/unit/, laid out as src/ is): no daemon process, no bucket server.
test-fast: venv
	$(PY) -m pytest -q tests/unit

# The accelerator path (tests/test_gpu.py) on a machine with a CUDA GPU; it skips elsewhere.
test-gpu: venv
	$(PY) -m pytest -q tests/test_gpu.py

test-slow: venv
	$(PY) -m pytest -q -m "slow and not faults and not fuzz and not frameworks and not model" tests

# The framework integrations driven by each framework's own training loop (Lightning,
# the Hugging Face Trainer, torchtitan, Orbax's CheckpointManager API) against a real daemon.
test-frameworks: venv
	$(PY) -m pytest -q -m frameworks tests

faults: venv
	$(PY) -m pytest -q -m faults tests

# Every RPC against one live daemon, CKPTD_FUZZ_EXAMPLES cases (default 10,000, the same
# ones each run; CKPTD_FUZZ_SEED=N for others); the summary goes to CKPTD_FUZZ_REPORT.
CKPTD_FUZZ_REPORT ?= bench/results/fuzz.json
fuzz: venv
	CKPTD_FUZZ_REPORT=$(CKPTD_FUZZ_REPORT) $(PY) -m pytest -q -m fuzz tests/fuzz

# The model checker (tests/model/): CKPTD_MODEL_SEQUENCES generated sequences (default 1,000)
# of CKPTD_MODEL_STEPS operations (default 20) against a real daemon, SeaweedFS, a peer and
# trainers killed or run as two users, each checked against the model; new sequences each
# run (CKPTD_MODEL_SEED=N: the same ones again), the failures kept in .hypothesis/ replayed
# first; each failure shrunk; the counts printed and written to CKPTD_MODEL_REPORT. Batches of
# CKPTD_MODEL_BATCH sequences (default 25), CKPTD_MODEL_WORKERS at once (default 2), each with
# its own seed (CKPTD_MODEL_SEED + its number), the report merged as each ends.
CKPTD_MODEL_REPORT ?= bench/results/model-check.json
model-check: venv
	CKPTD_MODEL_REPORT=$(CKPTD_MODEL_REPORT) $(PY) tests/model/batches.py

# Soak: 8 clients saving for 10 minutes against one daemon; SOAK_ARGS=--quick for 30 s.
soak: venv
	$(PY) bench/soak/soak.py $(SOAK_ARGS)

# Goodput under failures (bench/goodput/run.py): the short version, under 10 minutes;
# `$(PY) bench/goodput/run.py` alone runs the full matrix (3 MTBFs x 3 schedules).
goodput: venv
	$(PY) -m pip install -q -e '.[docs]'
	$(PY) bench/goodput/run.py --quick

# The goodput simulator's costs, measured (bench/goodput/costs.py): the GPU-like
# trainer, ckptd and Orbax, ~6 minutes; writes bench/goodput/costs-gpu-like.json.
.PHONY: goodput-costs
goodput-costs: venv
	$(PY) bench/goodput/costs.py --trainer gpu-like

# The README's dashboard screenshot: a live daemon, SeaweedFS and Prometheus, every
# panel's own PromQL drawn by matplotlib (deploy/grafana/render.py; about 2 minutes).
dashboard: venv promtool
	$(PY) -m pip install -q -e '.[docs]'
	$(PY) deploy/grafana/render.py

# The documentation site (mkdocs.yml, docs/): the generated reference pages checked
# against the code, then the site built into site/ with --strict (a broken link or
# anchor fails it). After changing a config key or a metric: $(PY) docs/gen_reference.py
.PHONY: docs
docs: venv
	$(PY) -m pip install -q -e '.[docs]'
	$(PY) docs/gen_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# The test extra includes jax and Orbax, which the benchmarks compare against.
bench: venv bench-deps bench-dlrover bench-peers
	$(PY) bench/run_all.py

# torch for the DCP tests and bench_transformer.py's PyTorch DCP arm, always a CPU build:
# the wheel in TORCH_WHEEL_DIR when there is one, else torch==TORCH_VERSION from PyTorch's
# CPU index (never PyPI's torch, which is a CUDA build). Installed by the venv target
# before the test extra; bench-deps remains for scripts that call it.
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
define install_torch_cpu
@if $(PY) -c "import torch" 2>/dev/null; then \
		$(PY) -c "import torch; print('torch', torch.__version__, 'already installed')"; \
	elif ls $(TORCH_WHEEL_DIR)/torch-$(TORCH_VERSION)+cpu-*.whl >/dev/null 2>&1; then \
		$(PY) -m pip install -q $(TORCH_WHEEL_DIR)/torch-$(TORCH_VERSION)+cpu-*.whl; \
	else \
		$(PY) -m pip install -q --index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION); \
	fi
endef

bench-deps: venv
	$(install_torch_cpu)

# DLRover Flash Checkpoint for bench_restart.py's dlrover arm, in a venv of its own:
# dlrover without its dependency list (its extras pull frameworks), the modules its flash
# checkpoint imports, and the CPU torch above (PY is this venv's python here). The
# constraint torch<0 makes pip fail rather than ever fetch a (CUDA) torch.
DLROVER_VENV := .venv-dlrover
DLROVER_STAMP := $(DLROVER_VENV)/.installed
DLROVER_DEPS := numpy==2.4.6 psutil==7.2.2 pynvml==13.0.1 Deprecated==1.3.1 \
	packaging==26.4 requests==2.34.2 grpcio==1.85.3

$(DLROVER_STAMP): PY := $(DLROVER_VENV)/bin/python
$(DLROVER_STAMP): Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(DLROVER_VENV) || python3 -m venv $(DLROVER_VENV)
	$(install_torch_cpu)
	printf 'torch<0\n' > $(DLROVER_VENV)/no-torch.txt
	$(PY) -m pip install -q --no-deps dlrover==0.6.1
	$(PY) -m pip install -q -c $(DLROVER_VENV)/no-torch.txt $(DLROVER_DEPS)
	touch $@

.PHONY: bench-dlrover
bench-dlrover: $(DLROVER_STAMP)

# The peers bench_default_save.py times beside ckptd, on the same tensors: NVRx's
# async save and DLRover's flash checkpoint (bench/peer_arms.py), without their
# dependency lists (never a CUDA torch: the constraint torch<0 makes pip fail instead).
PEERS_STAMP := $(VENV)/.bench-peers
$(PEERS_STAMP): Makefile | venv
	printf 'torch<0\n' > $(VENV)/no-torch.txt
	$(PY) -m pip install -q --no-deps dlrover==0.6.1 nvidia-resiliency-ext==0.4.1
	$(PY) -m pip install -q -c $(VENV)/no-torch.txt psutil pynvml==13.0.1 Deprecated==1.3.1 \
		defusedxml nvidia-ml-py pyyaml
	touch $@

.PHONY: bench-peers
bench-peers: $(PEERS_STAMP)

proto: venv
	$(PY) -m ckptd.proto.generate

typecheck: venv
	$(PY) -m mypy --config-file pyproject.toml

lint: venv typecheck
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache

# MaxText's own checkpointing and train loop through ckptd's Orbax Checkpointer (0.2.5:
# Orbax's v1 API) or CheckpointManager (up to 0.2.4: v0) (tests/frameworks/test_maxtext.py).
# MaxText needs Python 3.12, so it gets its own venv: MaxText without its dependency
# list (which pins CUDA/TPU stacks), the packages its checkpointing module and train
# loop import, jax on CPU, and ckptd. MAXTEXT_VERSION=0.2.4 tests the older release.
# The constraint torch<0 makes pip fail rather than ever fetch a (CUDA) torch.
# The first python3.12 that runs (a pyenv shim may not); PY312=... to choose another.
PY312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
	$$p -c '' 2>/dev/null && echo $$p && break; done)
MAXTEXT_VERSION ?= 0.2.5
MAXTEXT_VENV := .venv-maxtext
MAXTEXT_STAMP := $(MAXTEXT_VENV)/.installed-$(MAXTEXT_VERSION)
MAXTEXT_DEPS := jax==0.12.0.1 jaxlib==0.12.0.1 flax==0.12.12 orbax-checkpoint==0.12.8 \
	grain==0.2.18 optax==0.2.8 etils==1.15.0 absl-py==2.5.1 PyYAML==6.0.4 \
	omegaconf==2.4.0 ml_collections==1.1.0 pathwaysutils==0.1.13 drjax==0.2.1 \
	jaxtyping==0.3.11 qwix==0.1.8 aqtp==0.9.0 tokamax==0.0.17 transformers==5.24.0 \
	huggingface_hub==2.4.0 sentencepiece==0.2.3 tiktoken==0.14.0 Jinja2==3.1.6 \
	sympy==1.14.0 pillow==13.0.0 ml_goodput_measurement==0.2.3

$(MAXTEXT_STAMP): pyproject.toml Makefile
	@test -n "$(PY312)" || { echo 'test-maxtext needs Python 3.12: set PY312=/path/to/python3.12'; exit 1; }
	$(PY312) -m venv $(MAXTEXT_VENV)
	rm -f $(MAXTEXT_VENV)/.installed*  # another MaxText version's stamp
	printf 'torch<0\n' > $(MAXTEXT_VENV)/no-torch.txt
	$(MAXTEXT_VENV)/bin/pip install -q --no-deps maxtext==$(MAXTEXT_VERSION)
	$(MAXTEXT_VENV)/bin/pip install -q -c $(MAXTEXT_VENV)/no-torch.txt $(MAXTEXT_DEPS)
	$(MAXTEXT_VENV)/bin/pip install -q -c $(MAXTEXT_VENV)/no-torch.txt -e '.[jax]'
	touch $@

.PHONY: test-maxtext
test-maxtext: venv $(MAXTEXT_STAMP)
	$(PY) -m pytest -q tests/frameworks/test_maxtext.py

# Distribution: `make wheel` writes dist/ckptd-<version>-py3-none-any.whl (install it
# with `pip install dist/ckptd-*.whl`); `make image` builds the daemon's image
# $(IMAGE):$(TAG) from the Dockerfile with docker, podman or buildah, whichever works
# here (CONTAINER_ENGINE=... to choose); `make push REGISTRY=registry.example.com/team`
# pushes it as $(REGISTRY)/$(IMAGE):$(TAG), the name deploy/k8s/kustomization.yaml's
# `images:` then gives the manifests.
.PHONY: wheel image push
DIST ?= dist
IMAGE ?= ckptd
TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REGISTRY ?=
# docker needs its daemon answering; podman and buildah need none.
CONTAINER_ENGINE ?= $(shell for e in docker podman buildah; do \
	command -v $$e >/dev/null 2>&1 || continue; \
	if [ $$e != docker ] || docker info >/dev/null 2>&1; then echo $$e; break; fi; done)
define no_engine
{ echo "make $@: no container engine to build with: none of docker (with its daemon running), podman or buildah works here. Install one (podman needs no daemon), start the docker daemon, or set CONTAINER_ENGINE=<command>." >&2; exit 1; }
endef

wheel: venv
	rm -rf build  # a stale build/lib would put deleted modules into the wheel
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation . -w $(DIST)
	@ls $(DIST)/ckptd-*.whl

image:
	@test -n "$(CONTAINER_ENGINE)" || $(no_engine)
	@test -n "$(TAG)" || { echo "make $@: no TAG (pyproject.toml's version was not found); set TAG=..." >&2; exit 1; }
	@if [ "$(notdir $(CONTAINER_ENGINE))" = buildah ]; then \
		set -x; $(CONTAINER_ENGINE) bud -t $(IMAGE):$(TAG) -f Dockerfile . ; \
	else set -x; $(CONTAINER_ENGINE) build -t $(IMAGE):$(TAG) -f Dockerfile . ; fi

push: image
	@test -n "$(REGISTRY)" || { echo "make $@: set REGISTRY to where the image goes, e.g. make push REGISTRY=registry.example.com/team (it is pushed as REGISTRY/$(IMAGE):$(TAG))" >&2; exit 1; }
	$(CONTAINER_ENGINE) tag $(IMAGE):$(TAG) $(REGISTRY)/$(IMAGE):$(TAG)
	$(CONTAINER_ENGINE) push $(REGISTRY)/$(IMAGE):$(TAG)
