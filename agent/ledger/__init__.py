"""The preemption cost ledger: what every notice, flush, resume and checkpoint cost on this host, kept in an
SQLite file in the state directory and read back by ``preemptd report`` (docs/ledger.md)."""
