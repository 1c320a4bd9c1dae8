#!/usr/bin/env bash
# Compiles every csrc/*.cu with `nvcc -c` (no GPU needed) so CUDA syntax errors show up on CPU
# machines too. Skips, successfully, where there is no nvcc. NVCC_FLAGS adds flags, e.g.
# NVCC_FLAGS="-gencode arch=compute_90,code=sm_90".
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || true)}
if [ -z "$NVCC" ] && [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then NVCC=$CUDA_HOME/bin/nvcc; fi
if [ -z "$NVCC" ]; then
  echo "check_nvcc: no nvcc found; skipping the CUDA compile check"
  exit 0
fi
shopt -s nullglob
sources=(csrc/*.cu)
if [ ${#sources[@]} -eq 0 ]; then
  echo "check_nvcc: no csrc/*.cu to compile"
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "check_nvcc: $("$NVCC" --version | tail -1)"
for src in "${sources[@]}"; do
  # shellcheck disable=SC2086  # NVCC_FLAGS is a list of flags
  "$NVCC" -c "$src" -o "$out/$(basename "$src").o" -Icsrc -Xcompiler -Wall,-Wextra ${NVCC_FLAGS:-}
  echo "check_nvcc: compiled $src"
done
