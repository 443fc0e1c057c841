#!/usr/bin/env bash
# One prepared GPU run of the bench/gpu/ package (< 8 minutes): Llama-3.1-8B target / Llama-3.2-1B draft shapes,
# random weights in bf16, no download. First the served application (router, draft pool, target pool on a
# local Ray, captured forwards, drafts from draft models agreeing with the target on 0.8 of tokens:
# bench/gpu/served.py; it needs ray[serve], pydantic, fastapi and llguidance importable, and the proto stubs
# of `make proto`, else it reports the import error and the rest runs), then the decoder alone with oracle
# drafts. Results (gpu.json, gpu.md, gpu.png, gpu.log, gpu_nvidia-smi.txt) go to the folder given as $1,
# else $OUT, else bench/results/.
#   bash bench/gpu.sh [OUT_DIR] [extra bench.gpu flags]     e.g. bash bench/gpu.sh "$OUT" --budget-s 200
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench/results}}"
shift || true
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the repo first; carried wheels (transformers) after
python="${PYTHON:-python3}"
nvidia-smi > "$out/gpu_nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" > "$out/gpu_nvidia-smi.txt"
"$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
    'cuda', torch.cuda.is_available(), torch.cuda.device_count(), 'GPU(s)')" 2>&1 | tee "$out/gpu.log"
# Sections stop starting work at --budget-s (default 330 s after the models are built); the hard
# limit below keeps the whole call under 8 minutes, and results are written after every section.
timeout --signal=INT --kill-after=15 455 "$python" -u -m bench.gpu --out "$out" --budget-s 330 "$@" 2>&1 | tee -a "$out/gpu.log"
status=${PIPESTATUS[0]}
echo "bench/gpu.sh: exit $status; results in $out" | tee -a "$out/gpu.log"
exit "$status"
