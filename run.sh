#!/usr/bin/env bash
# rayless set-up and entry point.
#   ./run.sh            install (first time), build the tiny model, run the default RL job on CPU engines
#   ./run.sh test       install (first time) and run the whole test suite
#   ./run.sh ARGS...    install (first time) and run `rayless ARGS...`
# Idempotent: the virtual environment is reused and reinstalled only when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")"

VENV="${RAYLESS_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.rayless-install-stamp"

log() { printf '\033[1m[run.sh]\033[0m %s\n' "$*" >&2; }

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

install() {
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
        log "rayless needs Python >= 3.10 (found $("$PYTHON" --version 2>&1)); set PYTHON=..."; exit 1
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating virtual environment in $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
    local want
    want="$(cat pyproject.toml; has_gpu && echo gpu || echo cpu)"
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
        return
    fi
    local pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
    if has_gpu; then
        log "GPU found: installing the CUDA build of torch"
        "${pip[@]}" 'torch>=2.6,<2.15'
    else
        log "no GPU: installing the CPU build of torch"
        "${pip[@]}" 'torch==2.13.0'
    fi
    log "installing rayless and its test tools"
    "${pip[@]}" -e '.[dev]'
    printf '%s' "$want" > "$STAMP"
}

# The real sglang wheel for the tests that run SGLang's own code against ours: its weight-sync code
# (tests/support/sglang_parts.py compiles single files from the installed wheel) and its frontend
# (RuntimeEndpoint, gen, select, run_batch driving `rayless engine`: tests/integration/test_engine_sglang_frontend.py).
# `import sglang` needs the wheel plus triton and a few pure packages beyond ours; all go --no-deps into one
# --target directory that only those tests put on a child's PYTHONPATH, never into the venv's site-packages
# (~1.3 GB, triton ~1 GB; ~60-80 s once). sglang 0.5.22+ ships cp311+ wheels only (manylinux_2_34, glibc >= 2.34);
# 0.5.21, the newest for Python 3.10, has the same weight-sync code and the begin/end weight-update session.
SGLANG_SITE="$VENV/sglang-site"
install_sglang_for_tests() {
    local sglang=sglang==0.5.23
    "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || sglang=sglang==0.5.21
    local want="$sglang triton==3.9.0 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 requests==2.34.2"
    want="$want urllib3==2.8.0 charset-normalizer==3.5.3 ipython==9.18.1 traitlets==5.16.1"
    local stamp="$SGLANG_SITE/.rayless-install-stamp"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return
    fi
    log "installing the real sglang wheel for the tests, without dependencies, into $SGLANG_SITE (~1.3 GB, once)"
    rm -rf "$SGLANG_SITE"
    # shellcheck disable=SC2086 # $want is a list of requirement specifiers
    if ! "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
            --target "$SGLANG_SITE" $want; then
        log "could not install $want (the tests that run SGLang's own code need it)"; exit 1
    fi
    printf '%s' "$want" > "$stamp"
}

install 2>&1 | grep -v '^WARNING: Location' >&2 || true
[ -x "$VENV/bin/rayless" ] || { log "installation failed"; exit 1; }
export PATH="$PWD/$VENV/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

case "${1:-}" in
    test)
        shift
        install_sglang_for_tests 2>&1 | grep -v '^WARNING: Location' >&2 || true
        [ -f "$SGLANG_SITE/.rayless-install-stamp" ] || { log "installing the sglang wheel for the tests failed"; exit 1; }
        RAYLESS_SGLANG_SITE="$(cd "$SGLANG_SITE" && pwd)"
        RAYLESS_SGLANG_FRONTEND_SITE="$RAYLESS_SGLANG_SITE"
        export RAYLESS_SGLANG_SITE RAYLESS_SGLANG_FRONTEND_SITE
        # Two workers, one test file each at a time (module-scoped engines stay shared): most integration tests
        # wait on processes they start, so two files in flight fill the 2 cores of CI (16 min -> 9.5 min there).
        # RAYLESS_TEST_WORKERS=0 runs everything in this process.
        exec "$VENV/bin/python" -m pytest -q -n "${RAYLESS_TEST_WORKERS:-2}" --dist loadfile "$@"
        ;;
    "")
        RUN_DIR="${RAYLESS_RUN_DIR:-runs/default}"
        MODEL_DIR="runs/tiny-model"
        [ -f "$MODEL_DIR/model.safetensors" ] || "$VENV/bin/rayless" make-tiny-model "$MODEL_DIR"
        log "default job: 2 CPU engines, 2 torchrun ranks (gloo), task 'first digit'; run dir $RUN_DIR"
        exec "$VENV/bin/rayless" train \
            --hf-checkpoint "$MODEL_DIR" \
            --prompt-data builtin:first_digit --rm-type first_digit \
            --rollout-num-engines 2 --actor-num-gpus-per-node 2 \
            --rollout-batch-size 32 --n-samples-per-prompt 8 --num-rollout 60 \
            --rollout-max-response-len 4 --rollout-temperature 1.0 --rollout-shuffle \
            --lr 3e-3 --clip-grad 1.0 --eps-clip 0.2 \
            --sglang-server-concurrency 128 \
            --save "$RUN_DIR/ckpt" --save-interval 10 \
            --run-dir "$RUN_DIR"
        ;;
    *)
        exec "$VENV/bin/rayless" "$@"
        ;;
esac
