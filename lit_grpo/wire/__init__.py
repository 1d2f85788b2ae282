"""What the trainer and the rollout servers share, imported by both sides and by neither side's other code: the
HTTP protocol (``protocol``: routes, request and response shapes, errors, the JSON client; no torch), the shared
token and the loopback rule (``auth``: one reader of the token for every side, no torch), the
bytes of a weight push (``weight_transfer``: the process group, packing, buckets, waits, checksums), the one
round format of a push with its packer and validator (``push_format``) and the gloo
weight-transfer backend for ``vllm serve`` (``vllm_gloo``: a vLLM plugin, its worker side and its trainer side).
It imports ``core`` only. Importing this package imports nothing heavy; import the module you need."""
