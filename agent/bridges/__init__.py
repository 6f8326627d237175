"""Scheduler bridges (Slurm, Ray, Kubernetes, ...): reactors that tell a scheduler about notices.

Each bridge is a module here (or a package) that defines ``build_reactor(host)`` and its registry entry
``REACTOR = Part(name, build_reactor, (Table("actions.<name>", Schema),))``, listed in the reactor registry's
built-in tuple (:mod:`agent.actions.registry`). See docs/internals.md, "How to add a bridge".
"""
