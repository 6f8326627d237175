"""The framework adapters, each imported by name and each importing its framework: ``torch.py`` (state-dict
writers and the ranks' agreement on the job's own process group), ``lightning.py`` (PyTorch Lightning's
callback), ``hf.py`` (the Hugging Face Trainer's callback), and what the two callbacks share,
``callbacks.py`` (their options, ``WatchOptions``; standard library only). This ``__init__`` imports none
of them. ``agent.client.torch``, ``agent.client.lightning`` and ``agent.client.hf``, the paths docs/client.md
gives, re-export the first three."""
