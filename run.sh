#!/usr/bin/env bash
# rayless set-up and entry point.
#   ./run.sh            install what running needs (first time), build the tiny model, run the default RL job
#   ./run.sh test       install it with the test tools (first time) and run the whole test suite
#   ./run.sh ARGS...    install (first time) and run `rayless ARGS...` in the directory you called it from
# Idempotent: the virtual environment (.venv beside this script) is reused and reinstalled only when
# pyproject.toml changes or the test tools are wanted and missing. To type `rayless ...` as the docs do:
#   source .venv/bin/activate
set -euo pipefail
CALLER_DIR="$PWD"  # `./run.sh ARGS` runs there, so relative paths mean what they meant to the caller
cd "$(dirname "$0")"
ROOT="$PWD"

VENV="${RAYLESS_VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.rayless-install-stamp"

log() { printf '\033[1m[run.sh]\033[0m %s\n' "$*" >&2; }

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# What an install holds, as the stamp records it: pyproject.toml, the torch build, and on the last line the
# extras ("run": rayless and what running needs; "dev": plus the test tools, a superset of "run").
install_base() { cat pyproject.toml; has_gpu && echo gpu || echo cpu; }
installed_extras() { [ -f "$STAMP" ] && tail -n 1 "$STAMP" | sed -n 's/^extras=//p'; }
installed_base() { [ -f "$STAMP" ] && sed '$d' "$STAMP"; }

# pip, with one line per package (its size when downloaded) and the elapsed time instead of pip's own output
INSTALL_STARTED="$(date +%s)"  # the clock of the progress lines: one for the whole install
pip_install() {
    local rc
    set +e
    "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 \
        | "$PYTHON" "$ROOT/tools/pip_progress.py" --started "$INSTALL_STARTED"
    rc="${PIPESTATUS[0]}"
    set -e
    return "$rc"
}

install_env() {  # $1: run | dev
    local extras="$1" want had
    want="$(install_base)"
    had="$(installed_extras || true)"
    # up to date: the same pyproject.toml and torch build, and the extras asked for (dev holds run's)
    if [ -x "$VENV/bin/python" ] && [ "$(installed_base || true)" = "$want" ] \
            && { [ "$had" = dev ] || [ "$had" = "$extras" ]; }; then
        return
    fi
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        log "rayless needs Python >= 3.10 (found: $("$PYTHON" --version 2>&1 || echo "no $PYTHON")); set PYTHON=..."
        exit 1
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating virtual environment in $VENV"
        "$PYTHON" -m venv "$VENV" || return 1
    fi
    if has_gpu; then
        log "GPU found: installing the CUDA build of torch (~2.5 GB download on a first install)"
        pip_install 'torch>=2.6,<2.15' || return 1
    else
        log "no GPU: installing the CPU build of torch (~200 MB download on a first install)"
        pip_install 'torch==2.13.0' || return 1
    fi
    if [ "$extras" = dev ]; then
        log "installing rayless and its test tools (pytest, ruff, hypothesis, playwright, verifiers, ...)"
        pip_install -e '.[dev]' || return 1
    else
        log "installing rayless and what running needs (the test tools come with ./run.sh test)"
        pip_install -e . || return 1
    fi
    printf '%s\nextras=%s' "$want" "$extras" > "$STAMP"
    log "installed in $(( $(date +%s) - INSTALL_STARTED )) s; to type \`rayless ...\` as the docs do: source .venv/bin/activate"
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
    if ! pip_install --no-deps --target "$SGLANG_SITE" $want; then
        log "could not install $want (the tests that run SGLang's own code need it)"; exit 1
    fi
    printf '%s' "$want" > "$stamp"
}

if [ "${1:-}" = test ]; then extras=dev; else extras=run; fi
install_env "$extras" || { log "installation failed (pip's errors above)"; exit 1; }
[ -x "$VENV/bin/rayless" ] || { log "installation failed"; exit 1; }
export PATH="$VENV/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

case "${1:-}" in
    test)
        shift
        install_sglang_for_tests || true
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
        # The default job runs in the repository root: its paths (runs/default, runs/tiny-model) are the README's.
        RUN_DIR="${RAYLESS_RUN_DIR:-runs/default}"
        MODEL_DIR="runs/tiny-model"
        [ -f "$MODEL_DIR/model.safetensors" ] || "$VENV/bin/rayless" make-tiny-model "$MODEL_DIR"
        log "default job: 2 CPU engines, 2 torchrun ranks (gloo), task 'first digit'; run dir $RUN_DIR"
        export RAYLESS_DEFAULT_JOB=1  # a refused run directory is then answered with ./run.sh's choices
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
        cd "$CALLER_DIR"  # relative paths in ARGS are the caller's
        exec "$VENV/bin/rayless" "$@"
        ;;
esac
