"""The RAM tier's client half: the agent's RAM tier as a job sees it (:mod:`.ramtier`, standard library only),
the evacuation of an emergency sharded save into the RAM of the hosts without a notice (:mod:`.evacuate`),
the resume from those tiers (:mod:`.resume`) and the full-state store's peer tier (:mod:`.store`). Each
module is imported by name: this package imports none of them (the evacuation needs torch).
"""
