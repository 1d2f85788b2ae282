"""The rollout server process, ``python -m lit_grpo serve`` (``server``): the HTTP front and its route handlers,
one object each: generation and pause (``generation``), the server's side of a weight push (``weight_receive``),
and pi_ref's copy and log-probs for ``data.reference_on_server`` (``reference_routes``); the served policy's weights,
version and pause state that they share (``served_policy``). It imports the shared protocol (``lit_grpo.wire``) and
the in-process engine it generates with, ``core`` and ``models``; never the trainer's side (data, training,
callbacks, the command line). Importing this package imports nothing heavy (no
torch): ``serve --help`` answers at once."""
