"""The GSM8K Pass@k evaluator: Pass@1 is the fraction correct, pass@k the unbiased estimator."""

import math

import torch
from conftest import tiny_module, tiny_trainer
from lit_grpo.callbacks import GSM8KPassAtK

from lit_grpo.engines.base import Completion
from lit_grpo.evaluation.metric import PassAtK


def test_metric_reduces_sums_over_questions():
    metric = PassAtK(ks=[1, 3])
    metric.update(torch.tensor([0, 5]), 5)
    metric.update(torch.tensor([2]), 5)
    out = metric.compute()
    assert out[1].item() == (0 + 1 + 0.4) / 3
    p3 = 1 - math.comb(3, 3) / math.comb(5, 3)
    assert abs(out[3].item() - (0 + 1 + p3) / 3) < 1e-12


def test_evaluator_scores_fixed_completions(tmp_path, monkeypatch):
    module = tiny_module()
    trainer = tiny_trainer(tmp_path, max_steps=1)
    trainer.strategy.connect(module)
    evaluator = GSM8KPassAtK(num_samples=4, ks=[1, 2, 4], num_questions=3, questions_per_chunk=2,
                             system_prompt=None)
    golds = [row["gold"] for row in evaluator.rows]
    correct_counts = [1, 0, 3]
    tok = module.tokenizer
    calls = iter(range(100))

    def fake_generate(self, prompts, n, sampling, seed, all_finished=None):
        out = []
        for _ in prompts:
            q = next(calls)
            texts = [f"so #### {golds[q]}" if j < correct_counts[q] else "#### -1" for j in range(n)]
            out.append([Completion(tok(t, add_special_tokens=False)["input_ids"], [], False) for t in texts])
        return out

    monkeypatch.setattr("lit_grpo.evaluation.pass_at_k.TransformersEngine.generate", fake_generate)
    results = evaluator.evaluate(trainer, module)
    assert abs(results[1] - sum(correct_counts) / 12) < 1e-12
    for k in (2, 4):
        expected = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in correct_counts) / 3
        assert abs(results[k] - expected) < 1e-12
    assert evaluator.history[-1]["pass@1"] == results[1]


def test_evaluation_leaves_the_policy_mode_as_it_found_it(tmp_path):
    module = tiny_module()
    trainer = tiny_trainer(tmp_path, max_steps=1)
    trainer.strategy.connect(module)
    evaluator = GSM8KPassAtK(num_samples=2, ks=[1], num_questions=2, max_new_tokens=4, system_prompt=None)
    for training in (True, False):
        module.policy.train(training)
        evaluator.evaluate(trainer, module)
        assert module.policy.training is training
        assert all(m.training is training for m in module.policy.modules())


def test_chunks_are_dealt_round_robin_and_padded_for_lockstep():
    from lit_grpo.evaluation.pass_at_k import chunks_of_rank, question_chunks

    chunks = question_chunks(5, 2)
    assert chunks == [[0, 1], [2, 3], [4]]
    assert chunks_of_rank(chunks, 0, 2) == [[0, 1], [4]]
    assert chunks_of_rank(chunks, 1, 2) == [[2, 3], []]  # same number of slots: the empty one is run and discarded
    assert chunks_of_rank(chunks, 0, 1) == chunks
