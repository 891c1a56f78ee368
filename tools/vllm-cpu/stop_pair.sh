#!/usr/bin/env bash
# Stop the pair started by start_pair.sh: TERM each engine's process group (by the
# PIDs recorded in the run directory), then KILL after a grace period.
set -euo pipefail
exec python3 "$(dirname "$0")/pair.py" stop "$@"
