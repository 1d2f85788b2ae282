"""Rollout serving: the project's rollout server, the trainer's client for it and for ``vllm serve``, and the
weight push between them. Importing this package imports nothing heavy (no torch); import the module you need:

- ``protocol``: the HTTP protocol both sides share: routes, request checks and response shapes, the token
  (``$LIT_GRPO_SERVER_TOKEN``), limits, ``HTTPFailure`` / ``ServerError``, the JSON client ``HTTPClient``.
- ``server``: the server process (``python -m lit_grpo serve``, ``main(argv)``): ``RolloutServer``, the HTTP
  front, the token and the arguments (parsed before torch is imported).
- ``generation``: the server's generation backend (``/v1/completions`` by the transformers engine) and pause.
- ``weight_receive``: the server's side of a weight push (staging, the all-or-nothing swap, checksums).
- ``weight_transfer``: the bytes of a push, both sides: the process group, packing, buckets, waits, checksums.
- ``weight_push``: the trainer's side of a push (``WeightPusher.load_weights``: gathers, buckets, the outcome
  shared over the ranks).
- ``client``: ``ServerEngine``, the rollout engine that asks servers for completions (``request_rollouts``: HTTP
  only, safe on a background thread; ``check_lockstep``: the collective, on the training thread), checks their weight
  versions and pushes weights.
- ``vllm_client``: what differs for ``kind: vllm`` (request seeding, wire dtype, vLLM's own trainer-side
  transfer); imported only for that kind, vLLM itself only when used.
"""
