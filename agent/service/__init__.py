"""The service: the daemon that builds and hosts the parts (:mod:`~agent.service.daemon`), its lifecycle
(:mod:`~agent.service.server`), the HTTP API and metrics, persisted state, logging and systemd plumbing.
It may import every layer below it (sources, actions, bridges, advisor, config, client, core), never the CLI.
"""
