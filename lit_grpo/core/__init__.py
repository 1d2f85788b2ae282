"""What every role shares: the rollout batch (``batch``), the completions' teacher-forced log-probs
(``scoring``), process-group plumbing (``distributed``), checkpoint reading (``checkpoints``), option groups of the
configs (``option_groups``), callables named by import path (``import_paths``) and the logging of metrics only
some steps measure (``measured_metrics``: the training step's and the callbacks'). It imports ``lit_grpo.math``
at most, and every other role may import it."""
