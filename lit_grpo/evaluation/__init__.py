"""Evaluation: Pass@k over a dataset's questions (``pass_at_k``: sampling, scoring, the estimator of
``lit_grpo.math.pass_at_k``, the rows, the logged values and the printed table) and its torchmetrics ``Metric``
reduced over ranks (``metric``). Used by the ``GSM8KPassAtK`` callback, the ``eval`` command and the training CLI's
``validate`` and ``test``; it imports data, engines, models and plumbing, never training or the command line."""

from lit_grpo.evaluation.pass_at_k import (
    PassAtKSettings,
    chunks_of_rank,
    evaluate_pass_at_k,
    evaluate_pass_at_k_float32,
    evaluation_rows,
    log_pass_at_k,
    pass_at_k_table,
    question_chunks,
)

__all__ = ["PassAtKSettings", "chunks_of_rank", "evaluate_pass_at_k", "evaluate_pass_at_k_float32", "evaluation_rows",
           "log_pass_at_k", "pass_at_k_table", "question_chunks"]
