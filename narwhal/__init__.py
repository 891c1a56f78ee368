"""Narwhal: a router for disaggregated LLM serving, on Trio."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
