"""The full-state store's peer tier where docs/client.md names it; it lives in :mod:`agent.client.peer.store`."""

from agent.client.peer.store import Copy, PeerCheckpointStore, newest_copy, newest_held

__all__ = ["Copy", "PeerCheckpointStore", "newest_copy", "newest_held"]
