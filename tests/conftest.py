import os
import sys
from pathlib import Path

# before anything imports huggingface_hub, which reads these once: tests never reach the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import lightning as L  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # toy_rewards importable by path, in-process and in subprocesses
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
torch.set_num_threads(min(2, torch.get_num_threads()))

from lit_grpo.data.datamodule import RolloutDataModule  # noqa: E402
from lit_grpo.training.module import GRPOModule  # noqa: E402
from lit_grpo.training.optim import OptimizerArgs  # noqa: E402

TOY_REWARD = "toy_rewards:digit_fraction"


class MetricsRecorder(Callback):
    """Keeps a copy of every step's logged metrics."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def tiny_module(lr: float = 1e-3, **overrides) -> GRPOModule:
    """The tiny model's module; ``lr`` is shorthand for ``optimizer=OptimizerArgs(lr=lr)`` (an explicit
    ``optimizer`` wins)."""
    kwargs = dict(model_name="tiny-random-llama", optimizer=OptimizerArgs(lr=lr), temperature=1.0,
                  max_completion_length=8)
    kwargs.update(overrides)
    return GRPOModule(**kwargs)


def tiny_data(cls: type[RolloutDataModule] = RolloutDataModule, **overrides) -> RolloutDataModule:
    kwargs = dict(prompts_per_step=2, num_generations=4, micro_batch_size=4, max_new_tokens=8, temperature=1.0,
                  rewards=[TOY_REWARD], max_prompts=32, system_prompt=None, seed=0)
    kwargs.update(overrides)
    return cls(**kwargs)


def tiny_trainer(tmp_path, max_steps: int, callbacks=(), **overrides) -> L.Trainer:
    kwargs = dict(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                  callbacks=list(callbacks))
    kwargs.update(overrides)
    return L.Trainer(**kwargs)


def recorded_steps(workdir, module, data, max_steps: int, every_n_batches: int = 1) -> list[dict[str, float]]:
    """Each step's logged metrics of a fit of ``module`` on ``data`` with ``WeightSync(every_n_batches)``."""
    from lit_grpo.callbacks import WeightSync

    recorder = MetricsRecorder()
    trainer = tiny_trainer(workdir, max_steps=max_steps, callbacks=[WeightSync(every_n_batches=every_n_batches),
                                                                    recorder])
    trainer.fit(module, datamodule=data)
    return recorder.steps


@pytest.fixture
def recorder() -> MetricsRecorder:
    return MetricsRecorder()


@pytest.fixture
def one_thread():
    """torch on one thread, as the rollout servers of the tests run: the same thread count gives the same
    floating-point sums, so a server's numbers can be compared with the trainer's exactly."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
