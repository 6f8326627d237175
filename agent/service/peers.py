"""The peer's credentials and the administrator check, for the API: they live in :mod:`agent.core.peers`
so that components below the service layer can use them too."""

from agent.core.peers import is_admin, peer_credentials, peer_doc

__all__ = ["is_admin", "peer_credentials", "peer_doc"]
