"""Group REINFORCE with a KL penalty, a LightningModule of its own (not GRPOModule), trained with the four callbacks
of lit_grpo on a tiny Llama built from a config, fed by the project's RolloutDataModule: about half a minute on a
CPU. docs/foreign-module.md shows this file; tests/test_foreign_module.py runs it."""

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from lit_grpo.callbacks import GSM8KPassAtK, HFExport, RefModelSwap, WeightSync
from transformers import LlamaConfig, LlamaForCausalLM

from lit_grpo.core.batch import RolloutBatch
from lit_grpo.core.scoring import completion_logprobs
from lit_grpo.data.datamodule import RolloutDataModule
from lit_grpo.models.loading import tiny_tokenizer

TASK = "synthetic:add_2digit"  # two-digit sums in GSM8K's format, generated offline


def digits(completion: str, answer: str, **kwargs: object) -> float:
    """A reward with spread for an untrained model: the fraction of digits in the completion."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


class GroupReinforce(L.LightningModule):
    """REINFORCE with group-whitened rewards and a k3 KL penalty to pi_ref, averaged over completion tokens."""

    def __init__(self, beta: float = 0.05, lr: float = 1e-3) -> None:
        super().__init__()
        self.tokenizer = tiny_tokenizer()  # a character tokenizer; any Hugging Face tokenizer will do
        config = LlamaConfig(vocab_size=len(self.tokenizer), hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        self.policy = LlamaForCausalLM(config)
        self.reference = LlamaForCausalLM(config).requires_grad_(False)  # or None: no reference
        self.reference.load_state_dict(self.policy.state_dict())
        self.beta, self.lr = beta, lr

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> torch.Tensor:  # made by the data module
        tokens, loss, kl_sum = batch.completion_mask.sum(), 0.0, 0.0
        for mb in batch.micro_batches():
            logp, _ = completion_logprobs(self.policy, mb, temperature=1.0)
            with torch.no_grad():
                ref_logp, _ = completion_logprobs(self.reference, mb, temperature=1.0)
            kl = (torch.exp(ref_logp - logp) - (ref_logp - logp) - 1) * mb.completion_mask  # k3 estimator
            per_token = -mb.take(batch.advantages)[:, None] * logp * mb.completion_mask + self.beta * kl
            loss, kl_sum = loss + per_token.sum() / tokens, kl_sum + kl.detach().sum() / tokens
        self.log_dict({"train/loss": loss, "train/kl": kl_sum}, batch_size=1)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.policy.parameters(), lr=self.lr)


def main(steps: int = 4, out: str = "reinforce_run") -> L.Trainer:
    data = RolloutDataModule(dataset=TASK, rewards=[digits], prompts_per_step=2, num_generations=4,
                             micro_batch_size=8, max_new_tokens=8, system_prompt=None)  # in-process engine
    callbacks = [
        WeightSync(every_n_batches=2),  # the engine is the data module's rollout_engine
        RefModelSwap(every_n_batches=2),
        GSM8KPassAtK(every_n_batches=2, dataset=TASK, num_questions=4, num_samples=2, max_new_tokens=8,
                     system_prompt=None),
        HFExport(f"{out}/hf"),
    ]
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=CSVLogger(out), log_every_n_steps=1,
                        callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(GroupReinforce(), datamodule=data)
    return trainer


if __name__ == "__main__":
    main()
