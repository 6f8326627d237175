"""The exception hierarchy of preemptd.

PreemptdError
 ├── ConfigError        a configuration file, variable or flag is wrong (file, key, what was expected)
 ├── StateError         the state directory or a state file cannot be used
 ├── AlreadyRunningError another agent already serves the socket
 ├── NoticeError        a notice or event document is malformed (decode, drill request)
 └── ReportError        a client report is malformed
"""

from __future__ import annotations


class PreemptdError(Exception):
    """Root of every error preemptd raises on purpose."""


class ConfigError(PreemptdError):
    """The configuration is invalid; the message names the file, the key and what was expected."""


class StateError(PreemptdError):
    """The state directory or a state file cannot be used."""


class AlreadyRunningError(PreemptdError):
    """Another agent is live on the same socket."""


class NoticeError(PreemptdError):
    """A notice or event document is malformed."""


class ReportError(PreemptdError):
    """A client report is malformed."""
