"""The checkpoint format, which the training side writes and the agent's RAM tier reads and drains: a step's
manifest and its checks (:mod:`~agent.checkpoint.manifest`), files made durable and sealed
(:mod:`~agent.checkpoint.durable`), their CRC32 (:mod:`~agent.checkpoint.checksum`). Standard library only
(python-zlib-ng's CRC32 when installed), and nothing above :mod:`agent.core`: the client and the RAM tier
both build on it, neither on the other.
"""
