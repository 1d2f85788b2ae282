"""The callbacks work in a LightningModule that is not GRPOModule (supervised LM training here)."""

import lightning as L
import torch
from conftest import tiny_trainer
from lit_grpo.callbacks import GSM8KPassAtK, RefModelSwap, WeightSync
from torch.utils.data import DataLoader

from lit_grpo.engines import TransformersEngine
from lit_grpo.models.loading import load_model_and_tokenizer


class PlainLM(L.LightningModule):
    """Next-token prediction on random tokens; exposes only policy / reference / tokenizer."""

    def __init__(self) -> None:
        super().__init__()
        self.policy, self.tokenizer = load_model_and_tokenizer("tiny-random-llama")
        self.reference, _ = load_model_and_tokenizer("tiny-random-llama")

    def training_step(self, batch, batch_idx):
        return self.policy(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.policy.parameters(), lr=0.5)


def test_weight_sync_ref_swap_and_eval_in_a_plain_module(tmp_path):
    module = PlainLM()
    engine = TransformersEngine(module.policy, [module.tokenizer.eos_token_id], module.tokenizer.pad_token_id)
    data = DataLoader(torch.randint(4, 90, (12, 2, 16)), batch_size=None)
    sync = WeightSync(every_n_batches=3, engine=engine)
    swap = RefModelSwap(every_n_optimizer_steps=2)
    evaluator = GSM8KPassAtK(every_n_optimizer_steps=4, num_samples=2, ks=[1, 2], num_questions=2, max_new_tokens=4,
                             system_prompt=None)
    engine_steps = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            same = all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), pl_module.policy.parameters()))
            ref_same = all(torch.equal(a, b) for a, b in zip(pl_module.reference.parameters(),
                                                             pl_module.policy.parameters()))
            engine_steps.append((trainer.global_step, engine.synced_step, same, ref_same))

    trainer = tiny_trainer(tmp_path, max_steps=6, callbacks=[sync, swap, evaluator, Watch()])
    trainer.fit(module, train_dataloaders=data)
    assert [s for _, s, _, _ in engine_steps] == [0, 0, 3, 3, 3, 6]
    assert all(same == (g == s) for g, s, same, _ in engine_steps)
    assert [r for g, _, _, r in engine_steps] == [False, True, False, True, False, True]
    assert swap.swaps == 3
    assert [int(h["step"]) for h in evaluator.history] == [4, 6]
    assert all(0.0 <= h["pass@1"] <= h["pass@2"] <= 1.0 for h in evaluator.history)
    state = sync.state_dict()
    assert state["num_syncs"] == 2 and state["last_sync_step"] == 6
