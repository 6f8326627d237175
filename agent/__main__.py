"""``python -m agent`` is ``preemptd``."""

import sys

from agent.cli import main

sys.exit(main())
