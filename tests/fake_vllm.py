"""A stand-in for the parts of vLLM 0.32 that the gloo plugin's worker side uses (its ``WeightTransferEngine``
base and the layerwise-reload hooks), so that the worker runs in the default suite, without vLLM."""

from __future__ import annotations

import sys
import types

import pytest
import torch


class _Engine:
    """vLLM 0.32's ``WeightTransferEngine`` as far as the gloo engine uses it."""

    def __init__(self, config, vllm_config, device, model) -> None:  # noqa: ANN001
        self.config, self.vllm_config, self.device, self.model = config, vllm_config, device, model
        self.parallel_config = vllm_config.parallel_config
        self.model_config = vllm_config.model_config

    def parse_init_info(self, init_dict: dict):  # noqa: ANN201
        return self.init_info_cls(**init_dict)

    def parse_update_info(self, update_dict: dict):  # noqa: ANN201
        return self.update_info_cls(**update_dict)


def gloo_worker_over(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> tuple[object, list[str]]:
    """The plugin's worker engine over ``model`` with vLLM's modules stood in for; ``(worker, calls)``, ``calls``
    recording the layerwise-reload hooks in order."""
    from lit_grpo.wire.vllm_gloo import make_worker_engine_class

    calls: list[str] = []
    modules = {
        "vllm.distributed.weight_transfer.base": {"WeightTransferEngine": _Engine},
        "vllm.model_executor.model_loader.reload": {
            "initialize_layerwise_reload": lambda model: calls.append("initialize"),
            "finalize_layerwise_reload": lambda model, config: calls.append("finalize")},
    }
    for name, members in modules.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**members))
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(world_size=1, data_parallel_index=0, rank=0),
                                   model_config=None)
    return make_worker_engine_class()(None, config, torch.device("cpu"), model), calls
