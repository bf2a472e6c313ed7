"""Triptych's processes: the daemon, workers, clients, the demo and the benchmark."""

import os

# transformers prints advice on stderr while diffusers' lazy imports run (that torchvision
# is missing, say), and stderr carries a worker's JSON log. The level must be set before
# transformers is first imported, so it is set here, where every entry point passes.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
