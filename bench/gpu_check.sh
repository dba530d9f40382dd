#!/usr/bin/env bash
# GPU check on a fresh machine with an NVIDIA GPU, torch, nvcc and no network (see bench/GPU.md):
# installs from .gpu_bundle/, compiles FlashInfer's modules, runs tests/gpu, serves a SmolLM2-shaped
# model to the openai client, then the ~1B bench. Stages have their own timeouts (about 14
# minutes at worst); $OUT/summary.json gathers them all.
# --dry-run: everything up to the first CUDA call, on CPU (sources generated, tests skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
OUT="${OUT:-$PWD/gpu_check_out}"
BUNDLE="${BUNDLE:-$PWD/.gpu_bundle}"
SITE="${SITE:-/tmp/atrium_gpu_site}"
PY="${PYTHON:-python3}"
# FA2 for the first correctness pass: "auto" (FA3 on sm90) adds one more module to compile.
PREFILL_KERNEL="${PREFILL_KERNEL:-fa2}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
: > "$OUT/stages.tsv"
export OUT PREFILL_KERNEL DRY_RUN BUNDLE SITE PY
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"  # ninja, for FlashInfer's JIT
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-$SITE/flashinfer_cache}"
if [ "$DRY_RUN" = 1 ]; then
    export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0a}"  # no GPU to ask
fi
status=0

summary() { timeout 20 "$PY" -m bench.gpu_summary "$OUT" > /dev/null || true; }

# stage NAME SECONDS HARD CMD...: runs CMD under a timeout and records it in stages.tsv. A failed
# HARD stage ends the check there (nothing after it can work); a soft one lets the rest run.
stage() {
    local name="$1" limit="$2" hard="$3" start rc
    shift 3
    echo "== $name (limit ${limit} s)"
    start=$(date +%s)
    if timeout "$limit" "$@"; then rc=0; else rc=$?; fi
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - start))" >> "$OUT/stages.tsv"
    if [ "$rc" != 0 ]; then
        echo "== FAILED: $name (exit $rc$([ "$rc" = 124 ] && echo ', timed out'))"
        status=1
        if [ "$hard" = hard ]; then summary; exit 1; fi
    fi
}

tools() {
    local missing=0 tool
    for tool in "$PY" timeout; do
        command -v "$tool" > /dev/null || { echo "missing: $tool"; missing=1; }
    done
    if [ "$DRY_RUN" = 0 ]; then
        for tool in nvidia-smi nvcc g++; do
            command -v "$tool" > /dev/null || { echo "missing: $tool (FlashInfer's JIT needs it)"; missing=1; }
        done
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || missing=1
        nvcc --version | tail -2 || missing=1
    fi
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" || missing=1
    if [ "$DRY_RUN" = 0 ]; then
        "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
            || { echo "missing: a CUDA device torch can see"; missing=1; }
    fi
    [ -f "$BUNDLE/manifest.json" ] || { echo "missing: $BUNDLE (python -m bench.gpu_bundle)"; missing=1; }
    return "$missing"
}

export -f tools  # timeout runs programs, not functions: it runs this one through bash -c
stage tools 60 hard bash -c tools
stage install 90 hard "$PY" -m bench.gpu_install "$BUNDLE" "$SITE" "$OUT/versions.json"
stage import 60 hard "$PY" -c "import flashinfer, tvm_ffi; print('flashinfer', flashinfer.__version__)"
warmup=("$PY" -m bench.gpu_warmup --prefill-kernel "$PREFILL_KERNEL" --out "$OUT/warmup.json"
    --manifest "$BUNDLE/manifest.json")
tests=("$PY" -m pytest tests/gpu -q -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml")
# A real `atrium serve` driven by the openai client (bench/gpu_serve.py), $OUT/serve.json.
serve=("$PY" -m bench.gpu_serve --tokenizer "$BUNDLE/tokenizer" --out "$OUT/serve.json")
if [ "$DRY_RUN" = 1 ]; then
    stage warmup 60 hard "${warmup[@]}" --dry-run
    stage tests 60 soft "${tests[@]}"
    stage serve 150 soft "${serve[@]}" --device cpu --shape tiny --burst 8 --dtype float32 \
        --kv-cache-bytes 67108864
    stage bench 60 soft "$PY" -m bench.gpu_bench --smoke --device cpu --out "$OUT/gpu_bench_torch.json"
else
    stage warmup 210 hard "${warmup[@]}"
    stage tests 120 soft "${tests[@]}"
    stage serve 300 soft "${serve[@]}" --device cuda
    stage bench_flashinfer 90 soft "$PY" -m bench.gpu_bench --prefill-kernel "$PREFILL_KERNEL"
    stage bench_torch 45 soft "$PY" -m bench.gpu_bench --backend torch
fi
summary
echo "== done (status $status); summary in $OUT/summary.json"
exit "$status"
