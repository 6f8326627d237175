"""Training-side client for preemptd: standard library only, cheap to import in every training process."""
