# Sourced by kvevict's scripts: puts the CUDA toolkit's nvcc on PATH when it is not already.
if ! command -v nvcc >/dev/null 2>&1; then
  for d in "${CUDA_PATH:-}" /usr/local/cuda; do
    if [[ -n "$d" && -x "$d/bin/nvcc" ]]; then export PATH="$d/bin:$PATH"; break; fi
  done
fi
