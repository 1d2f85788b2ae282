"""The callbacks name their unit: with i = 2 optimizer steps per rollout batch, "every 2 batches" and "every 2
optimizer steps" are different periods, and each callback counts the one it is given."""

from conftest import tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import GSM8KPassAtK, RefModelSwap, WeightSync


def test_batches_and_optimizer_steps_are_different_units(tmp_path):
    by_batches, by_steps = RefModelSwap(every_n_batches=2), RefModelSwap(every_n_optimizer_steps=2)
    sync = WeightSync(every_n_batches=2)
    evaluate = dict(num_samples=2, ks=[1], num_questions=1, max_new_tokens=4, system_prompt=None, at_end=False)
    eval_batches, eval_steps = GSM8KPassAtK(every_n_batches=3, **evaluate), GSM8KPassAtK(every_n_optimizer_steps=3,
                                                                                         **evaluate)
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
