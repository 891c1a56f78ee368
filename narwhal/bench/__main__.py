"""``python -m narwhal.bench``: the same as ``narwhal bench``."""

from __future__ import annotations

import sys

from narwhal.bench.cli import main

sys.exit(main())
