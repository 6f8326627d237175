"""The checkpoint interval advisor: how often to checkpoint, from measured save times and measured losses.

``math`` holds the pure formulas, ``estimate`` turns the history log into inputs, ``simulate`` checks the
formulas by Monte Carlo, ``component`` serves ``/v1/advice`` and ``cli`` the ``preemptd advise`` verb.
"""
