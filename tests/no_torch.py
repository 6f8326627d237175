"""A Python environment where PyTorch is not installed, for a child process: a ``sitecustomize`` that puts a
finder first on ``sys.meta_path`` refusing ``torch`` and its submodules (``import torch`` raises
``ModuleNotFoundError``, ``importlib.util.find_spec("torch")`` too), as in a venv with the base package only."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support import REPO

SITECUSTOMIZE = '''
import sys


class NoTorch:
    """PyTorch is not installed here."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoTorch())
'''


def no_torch_env(directory: Path) -> dict[str, str]:
    """This process's environment (``PREEMPTD_*`` left out) with ``directory`` first on ``PYTHONPATH``, holding
    the sitecustomize that refuses torch, then the repository."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    env["PYTHONPATH"] = os.pathsep.join((str(directory), str(REPO)))
    return env
