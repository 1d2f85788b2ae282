"""What every role shares: the rollout batch (``batch``), the completions' teacher-forced log-probs
(``scoring``), process-group plumbing (``distributed``), checkpoint reading (``checkpoints``), option groups of the
configs (``option_groups``) and callables named by import path (``import_paths``). It imports ``lit_grpo.math``
at most, and every other role may import it."""
