"""Evaluation: Pass@k over a dataset's questions (``pass_at_k``: sampling, scoring, the estimator of
``lit_grpo.math.pass_at_k``) and its torchmetrics ``Metric`` reduced over ranks (``metric``). Used by the
``GSM8KPassAtK`` callback and the ``eval`` command; it imports data, engines, models and plumbing, never training or
the command line."""

from lit_grpo.evaluation.pass_at_k import PassAtKSettings, chunks_of_rank, evaluate_pass_at_k, question_chunks

__all__ = ["PassAtKSettings", "chunks_of_rank", "evaluate_pass_at_k", "question_chunks"]
