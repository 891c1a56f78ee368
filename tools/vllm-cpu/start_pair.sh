#!/usr/bin/env bash
# Start a vLLM CPU NixlConnector producer/consumer pair on loopback and write its
# fleet document; see pair.py for the options. Prints NARWHAL_VLLM_PAIR=<run dir>.
set -euo pipefail
exec python3 "$(dirname "$0")/pair.py" start "$@"
