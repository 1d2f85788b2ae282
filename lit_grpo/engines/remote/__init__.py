"""The trainer's side of rollout servers (``data.engine: server``): ``client.ServerEngine``, the engine that asks
servers for completions and checks their weight versions, and the objects it owns: its ``connection.ServerConnection``
per server, the weight push (``weight_push.WeightPusher``, with rank 0's gather of FSDP2 shards in ``weight_gather``),
the pi_ref client (``reference_client.ReferenceClient``) and what differs for ``vllm serve`` (``vllm_client``,
imported only for that kind). The protocol and the bytes they speak are ``lit_grpo.wire``'s."""
