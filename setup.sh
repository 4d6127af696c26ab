#!/usr/bin/env bash
# Set up (or refresh) the project's virtualenv in .venv/: torch first, then v4rl itself with its test extras.
# torch is the CPU build, asked for by its local version (torch==2.13.0+cpu): from this machine's own wheels or
# index if it has them, else from PyTorch's CPU index (download.pytorch.org/whl/cpu), never a CUDA build from PyPI
# (several GB). GPU users set V4RL_TORCH_SPEC to their own build, e.g. V4RL_TORCH_SPEC='torch>=2.9'.
# Re-running is cheap: the install is skipped while pyproject.toml is unchanged. Last, the pinned SGLang's
# source for the conformance suite goes into a cache outside the repo (once; offline reruns reuse it).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.v4rl-installed
want=$(sha256sum pyproject.toml setup.sh | sha256sum | cut -c1-16)
engine_sources() {
  .venv/bin/python -c "from engines.upstream.sources import sglang_paths; sglang_paths()" ||
    echo "setup.sh: SGLang's source could not be cached; the conformance suite will skip its SGLang checks" >&2
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  engine_sources
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip
TORCH_CPU="torch==2.13.0+cpu" TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ -n "${V4RL_TORCH_SPEC:-}" ]; then
    .venv/bin/python -m pip install -q "$V4RL_TORCH_SPEC"
  elif ! .venv/bin/python -m pip install -q "$TORCH_CPU" 2>/dev/null; then
    echo "setup.sh: $TORCH_CPU is not on this machine's package index; installing it from $TORCH_CPU_INDEX" >&2
    .venv/bin/python -m pip install -q --index-url "$TORCH_CPU_INDEX" "$TORCH_CPU"
  fi
fi
.venv/bin/python -m pip install -q -e ".[test]"
echo "$want" > "$stamp"
engine_sources
