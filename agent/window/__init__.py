"""The effective notice window (docs/window.md): how long a job really gets after a notice, from the cloud's
lead and the limits on this host, set against the predicted emergency flush.

``effective`` holds the pure computation (leads, the binding limit, the verdict, its status, lines and metric
values), ``limits`` what a part offers the window (``Limit``, the ``window_limits`` registry), ``signals`` the
``[[actions.signals]]`` rules' limits, and ``component`` gathers the limits in the background and serves the
``window`` status section, the log and the metrics.
"""
