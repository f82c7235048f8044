#!/usr/bin/env bash
# The prepared GPU check (issue 11 item 10; issue 12 on CUDA): one script for one GPU machine with torch (CUDA)
# and no network, no SGLang, at most 8 minutes. Steps, each with a header and a PASS/FAIL line:
#   env          python, torch, CUDA, the GPUs, /dev/shm
#   gpu-tests    the gpu-marked tests (FSDP2 step vs CPU, our engine on CUDA, placement, colocation on CUDA)
#   colocate     the default job colocated on the one GPU (our engine on CUDA + one FSDP2 rank, disk sync through
#                tmpfs): seconds per phase of each step and the memory per phase (bench/colocate.py)
#   weight-sync  a colocated weight sync of a ~0.5 B-parameter random Qwen3-shaped model against a same-run floor
#                (CUDA→host copy + safetensors save + load of the same bytes) (bench/colocated_sync.py)
#   train-shapes a Qwen3-0.6B-shaped model (random weights, Qwen3's 151,936 vocabulary) in bf16 on 64 prompts × 8
#                long-tailed samples packed 16,384 tokens per micro-batch: tokens/s and MFU (prime-rl's published
#                figure for Qwen3-0.6B at 16k on one H100: 11.9k tokens/s, 11.1 % MFU), peak vs its chunked floor,
#                real/computed tokens, tokens/s vs forward+backward alone (bench/train_shapes.py); then packed
#                attention's paths side by side on 8 of those micro-batches (forward + backward: per-sample sdpa,
#                sdpa grouped by length, PyTorch's varlen_attn): tokens/s, kernel calls and MFU of each
#   offload      a ~100 M-parameter rank's state offloaded and onloaded through pinned host memory, non-blocking,
#                against the host↔device bandwidth measured in the same run (goal ≥ 0.5×) (bench/offload_bandwidth.py)
# `bench/gpu_check.sh --cpu` runs the same steps at tiny sizes on the CPU (CI runs it, so the script cannot rot).
# Output: every step's log under $OUT (the device tool's output directory) or a temp dir; summary.txt lists
# the verdicts. Exit status 1 when any step failed. Wheels of pure-Python dependencies the machine lacks may
# travel in .whl/ (installed into /tmp/site, no index, no dependencies).
set -u -o pipefail

MODE=gpu
if [[ "${1:-}" == "--cpu" ]]; then MODE=cpu; fi
# Each step's limit guards a lent GPU's minutes. On the CPU it only has to catch a hang: the limits below are
# tripled there, since a 2-core CI machine loaded by other work runs these steps many times slower than an idle
# one (a loaded run here cut weight-sync and train-shapes at 120 s and 150 s); the caller's own deadline bounds
# the whole (tests/integration/test_gpu_check_script.py: 840 s; at load 15-20 the six steps took 443 s, two of them cut at their limits).
LIMIT_SCALE=1
if [[ "$MODE" == cpu ]]; then LIMIT_SCALE=3; fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT_DIR="${OUT:-$(mktemp -d -t rayless-gpu-check-XXXXXX)}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [[ "$MODE" == cpu ]]; then export CUDA_VISIBLE_DEVICES=""; fi

FAILED=0
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"

# step NAME LIMIT_SECONDS COMMAND...: run it with a deadline, keep its output in $OUT_DIR/NAME.log
step() {
    local name=$1 limit=$(($2 * LIMIT_SCALE))
    shift 2
    echo
    echo "================ [$name] $* (limit ${limit}s) ================"
    local started=$SECONDS
    timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    local verdict=PASS
    if [[ $rc -ne 0 ]]; then verdict=FAIL; FAILED=1; fi
    if [[ $rc -eq 124 ]]; then verdict="FAIL (over its ${limit}s limit)"; fi
    echo "================ [$name] $verdict (exit $rc, $((SECONDS - started))s) ================"
    echo "[$name] $verdict (exit $rc, $((SECONDS - started))s)" >> "$SUMMARY"
}

step env 60 "$PY" - "$MODE" <<'PYEOF'
import os, shutil, subprocess, sys
import torch
mode = sys.argv[1]
print(f"mode {mode}; python {sys.version.split()[0]}; torch {torch.__version__} (CUDA build {torch.version.cuda})")
print(f"CUDA available: {torch.cuda.is_available()}; devices: {torch.cuda.device_count()}")
for index in range(torch.cuda.device_count()):
    free, total = torch.cuda.mem_get_info(index)
    print(f"  cuda:{index} {torch.cuda.get_device_name(index)}: {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
if shutil.which("nvidia-smi"):
    print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip())
if os.path.isdir("/dev/shm"):
    print(f"/dev/shm: {shutil.disk_usage('/dev/shm').free / 2**30:.1f} GiB free")
try:
    import sglang  # noqa: F401
    print("sglang: importable")
except ImportError:
    print("sglang: not installed (our engine on CUDA is used)")
sys.exit(0 if mode == "cpu" or torch.cuda.is_available() else 1)
PYEOF

if [[ "$MODE" == gpu ]]; then
    # only the files holding gpu-marked tests, as in --cpu mode: collecting every file would import the test-only
    # clients (openai, anthropic) this machine lacks, and a collection error stops the step before any test runs
    step gpu-tests "${GPU_TESTS_LIMIT:-210}" "$PY" -m pytest -m gpu $(grep -l "pytest.mark.gpu" tests/integration/*.py) \
        -q -p no:randomly -rs
    step colocate "${COLOCATE_LIMIT:-120}" "$PY" -m bench.colocate --device cuda --rollouts 4 \
        --hidden 1024 --layers 8 --intermediate 3072 --save-runs "$OUT_DIR/colocate-runs" --timeout 110
    step weight-sync "${WEIGHT_SYNC_LIMIT:-120}" "$PY" -m bench.colocated_sync --device cuda --repeats 3
    step train-shapes "${TRAIN_SHAPES_LIMIT:-300}" "$PY" -m bench.train_shapes --device cuda --bf16 --hidden 1024 \
        --layers 28 --intermediate 3072 --heads 16 --kv-heads 8 --head-dim 128 --max-tokens-per-gpu 16384 \
        --attention-paths per_sample,grouped,varlen --attention-batches 8
    step offload "${OFFLOAD_LIMIT:-90}" "$PY" -m bench.offload_bandwidth --device cuda --repeats 3
else
    # (limits: a loaded 2-core CI machine runs these many times slower than an idle one; tripled, see above)
    # the same steps, small: only the files holding gpu-marked tests (they skip here), the colocated schedule
    # alone, a model of 0.1 M parameters whose sync is all fixed per-request costs (so no target: figures only)
    step gpu-tests 120 "$PY" -m pytest -m gpu $(grep -l "pytest.mark.gpu" tests/integration/*.py) -q \
        -p no:randomly -rs
    step colocate 150 "$PY" -m bench.colocate --device cpu --rollouts 2 --schedules colocated \
        --save-runs "$OUT_DIR/colocate-runs" --timeout 140
    step weight-sync 120 "$PY" -m bench.colocated_sync --device cpu --hidden 64 --layers 2 --intermediate 128 \
        --repeats 2 --target inf
    # 4 prompts × 8 short samples on the real vocabulary: the bench's every figure, none gated at this size
    # (varlen is refused here: no CPU kernel; the line says so); the paths on one micro-batch (after its warm-up
    # pass): each path's every line, and a third of the CPU the batch's two took (forward + backward over the
    # 151,936-token vocabulary)
    # (--no-vlm: the VLM case would add a minute on these cores; the CUDA branch runs it)
    step train-shapes 150 "$PY" -m bench.train_shapes --quick --prompts 4 --report-only --no-vlm \
        --attention-paths per_sample,grouped,varlen --attention-batches 1
    step offload 90 "$PY" -m bench.offload_bandwidth --device cpu --hidden 64 --layers 2 --intermediate 128 \
        --vocab 1024 --repeats 2
fi

echo
echo "================ summary ($MODE mode; logs in $OUT_DIR) ================"
cat "$SUMMARY"
exit $FAILED
