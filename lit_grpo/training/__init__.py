"""The training step: ``GRPOModule`` (``module``), the registry of losses, the step's metrics and how they merge
over micro-batches, iterations and ranks, the optimizer, precision, FLOPs, and the warm-started demo model's SFT
recipe (``warm_start``). It imports the pure math, ``core``, models and (for the warm start) data; never the command
line, the engines, the server or evaluation."""
