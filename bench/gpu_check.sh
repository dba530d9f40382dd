#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU, PyTorch preinstalled and no network:
# installs carried wheels from .whl/, prints versions, runs tests/gpu, then the ~1B bench.
# Everything it writes goes to $OUT (default ./gpu_check_out). Budget: about 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
export OUT
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

if compgen -G ".whl/*.whl" > /dev/null; then
    echo "== installing carried wheels (no index, no deps) into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="/tmp/site/bin:$PATH"  # ninja, for FlashInfer's JIT
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"  # parallel JIT compilation of FlashInfer kernels

echo "== versions"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
command -v nvcc > /dev/null && nvcc --version | tail -2 || echo "nvcc: not found (FlashInfer JIT needs it)"
"$PY" - <<'PYEOF' | tee "$OUT/versions.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for name in ("flashinfer", "transformers", "tokenizers", "safetensors", "pytest"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:  # report every missing piece, then carry on
        print(name, "MISSING:", type(exc).__name__, exc)
PYEOF

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible: nothing to check here"; exit 2
fi
HAVE_FLASHINFER=0
"$PY" -c "import flashinfer" 2> /dev/null && HAVE_FLASHINFER=1

status=0
echo "== tests/gpu"
timeout 330 "$PY" -m pytest tests/gpu -q -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" \
    || status=1

echo "== bench (FlashInfer)"
if [ "$HAVE_FLASHINFER" = 1 ]; then
    timeout 150 "$PY" -m bench.gpu_bench || status=1
else
    echo "skipped: flashinfer is not importable"; status=1
fi
echo "== bench (torch attention backend on CUDA, for comparison)"
timeout 90 "$PY" -m bench.gpu_bench --backend torch || status=1

echo "== done (status $status); results in $OUT"
exit "$status"
