"""The ``dsv41`` command line (:mod:`.commands`) and what its commands run: the demo and the inspector.

Importing this package loads only the standard library; each command imports torch and the model when it runs.
"""

from .commands import main

__all__ = ["main"]
