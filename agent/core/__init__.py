"""The core: the notice pipeline and what every other part is typed against.

Notices and events (:mod:`~agent.core.notice`), the board that keeps them, the one fan-out and the SSE
subscribers it feeds, client reports, source health, the status document, the ports (Protocols) the parts
above are given, and the small shared helpers (owned tasks, threads, errors, durations, paths). Modules
here import only each other: nothing above them.
"""
