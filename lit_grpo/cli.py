"""``python -m lit_grpo fit --config configs/X.yaml``: LightningCLI over GRPOModule and RolloutDataModule."""

from __future__ import annotations

import warnings

from lightning.pytorch.cli import LightningCLI

from lit_grpo.data.datamodule import RolloutDataModule
from lit_grpo.module import GRPOModule


class GRPOCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001
        # The loss must use the temperature the rollouts were sampled with, and Dr.GRPO's constant
        # normaliser is the generation budget.
        parser.link_arguments("data.temperature", "model.temperature")
        parser.link_arguments("data.max_new_tokens", "model.max_completion_length")


def main(args: list[str] | None = None) -> GRPOCLI:
    # A checkpoint taken after a training step holds the state after all of that step's optimizer steps,
    # together with the data position and counters of the same moment: exactly what an exact resume needs.
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
    return GRPOCLI(
        GRPOModule,
        RolloutDataModule,
        save_config_kwargs={"overwrite": True},
        args=args,
    )
