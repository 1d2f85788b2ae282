"""The callbacks name their unit: with i = 2 optimizer steps per rollout batch, "every 2 batches" and "every 2
optimizer steps" are different periods, and each callback counts the one it is given."""

from conftest import tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import GSM8KPassAtK, RefModelSwap, WeightSync


def test_batches_and_optimizer_steps_are_different_units(tmp_path):
    by_batches, by_steps = RefModelSwap(every_n_batches=2), RefModelSwap(every_n_optimizer_steps=2)
    sync = WeightSync(every_n_batches=2)
    evaluate = dict(num_samples=2, ks=[1], num_questions=1, max_new_tokens=4, system_prompt=None, at_end=False)
    eval_batches = GSM8KPassAtK(every_n_batches=3, name="batches", **evaluate)
    eval_steps = GSM8KPassAtK(every_n_optimizer_steps=3, name="steps", **evaluate)
    trainer = tiny_trainer(tmp_path, max_steps=8, callbacks=[sync, by_batches, eval_batches, eval_steps])
    trainer.fit(tiny_module(iterations_per_batch=2, beta=0.1), datamodule=tiny_data())
    assert trainer.global_step == 8  # 4 rollout batches x i = 2
    # one RefModelSwap per trainer (a second is refused), so the other unit gets a fit of its own
    trainer = tiny_trainer(tmp_path, max_steps=8, callbacks=[WeightSync(every_n_batches=2), by_steps])
    trainer.fit(tiny_module(iterations_per_batch=2, beta=0.1), datamodule=tiny_data())
    assert by_batches.swaps == 2 and by_steps.swaps == 4
    assert sync.num_syncs == 2  # after batches 2 and 4 (the initial load is not counted)
    assert [h["step"] for h in eval_batches.history] == [6.0]  # after batch 3
    # optimizer steps 3 and 6 are crossed after batches 2 (step 4) and 3 (step 6); 9 is never reached
    assert [h["step"] for h in eval_steps.history] == [4.0, 6.0]


class LoggedMetrics:
    """A stand-in logger: every ``log_metrics`` call, as (step, metrics)."""

    def __init__(self) -> None:
        from lightning.pytorch.loggers.logger import DummyLogger

        self.logger = DummyLogger()
        self.calls: list[tuple[int, dict]] = []
        self.logger.log_metrics = lambda metrics, step=None: self.calls.append((step, dict(metrics)))


def test_two_named_evaluations_with_one_period_log_two_series(tmp_path):
    """Two evaluations in one fit (the same period, other samples): each logs under its own name, none under the
    unnamed key, and each keeps its own state in the checkpoint."""
    import pytest

    evaluate = dict(every_n_batches=1, ks=[1], num_questions=1, max_new_tokens=4, system_prompt=None, at_end=False)
    first, second = GSM8KPassAtK(name="small", num_samples=2, **evaluate), GSM8KPassAtK(name="large", num_samples=3,
                                                                                        **evaluate)
    assert first.state_key != second.state_key
    logged = LoggedMetrics()
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[first, second], logger=logged.logger)
    trainer.fit(tiny_module(), datamodule=tiny_data())
    keys = {key for _, metrics in logged.calls for key in metrics if key.startswith("eval")}
    assert keys == {"eval/small/pass@1", "eval/large/pass@1"}
    assert [step for step, m in logged.calls if "eval/small/pass@1" in m] == [1, 2]
    assert [step for step, m in logged.calls if "eval/large/pass@1" in m] == [1, 2]
    assert len(first.history) == len(second.history) == 2
    with pytest.raises(ValueError, match="name must be"):
        GSM8KPassAtK(name="a/b", **evaluate)


def test_two_unnamed_evaluations_are_refused_in_one_line(tmp_path):
    import pytest

    evaluate = dict(num_samples=2, ks=[1], num_questions=1, max_new_tokens=4, system_prompt=None, at_end=False)
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[GSM8KPassAtK(every_n_batches=1, **evaluate),
                                                             GSM8KPassAtK(every_n_batches=2, **evaluate)])
    with pytest.raises(ValueError, match=r"^2 Pass@k evaluations would log under eval/pass@k: give each its "
                                         r"own name \(e.g. name: gsm8k, name: math500\)$"):
        trainer.fit(tiny_module(), datamodule=tiny_data())
