"""Scheduler bridges (Slurm, Ray, Kubernetes, ...): reactors that tell a scheduler about notices.

Each bridge is a module here (or a package) that defines ``build_reactor(host)``; :mod:`agent.actions.registry`
finds it without any other edit. See docs/internals.md, "How to add a bridge".
"""
