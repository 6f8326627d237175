"""The checkpoint interval advisor: how often to checkpoint, from measured save times and measured losses.

``math`` holds the pure formulas, ``stats`` the robust statistics, ``estimate`` turns the history log into
inputs, ``advice`` turns inputs into the advice document, ``simulate`` checks the formulas by Monte Carlo,
``component`` serves ``/v1/advice`` and ``cli``/``plot`` the ``preemptd advise`` verb. See docs/advisor.md.
"""
