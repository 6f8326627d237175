"""preemptd: a node agent that tells training processes their host is about to go away.

This package must stay cheap to import: training processes import ``agent.client``, which pulls in this
module, so nothing heavy (aiohttp, pynvml, structlog) may be imported here.
"""

__version__ = "0.1.0"
