from __future__ import annotations

import sys

from narwhal.cli import main

sys.exit(main())
