"""``python -m agent.simulate <cloud>``: the same as ``preemptd simulate <cloud>``."""

import sys

from agent.simulate.cli import main

sys.exit(main())
