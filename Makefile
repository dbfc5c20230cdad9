# The two commands of the README: `make serve` and `make test`. Both set up .venv first.
.PHONY: setup serve test

MODEL_DIR ?= .cache/models/tiny
PROMPT ?= Hello! Tell me about TPUs.

setup:
	@scripts/setup.sh

serve: setup
	@test -f $(MODEL_DIR)/config.json || .venv/bin/serve-tpu make-model tiny $(MODEL_DIR)
	.venv/bin/serve-tpu generate $(MODEL_DIR) --prompt "$(PROMPT)" --max-tokens 32

test: setup
	.venv/bin/python -m pytest -q
