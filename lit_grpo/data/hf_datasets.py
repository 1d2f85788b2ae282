"""Rows from the ``datasets`` library: a Hub id, or a folder written by ``Dataset.save_to_disk`` (or
``DatasetDict.save_to_disk``). Both become rows through :func:`dataset_rows`, so the code a Hub dataset takes is the
code a local ``datasets`` folder takes, and the tests run it on a folder saved here, with no network.

A Hub id is loaded with the config it is given, else the dataset's default (GSM8K's own ids, which have no default,
get their ``main``). Unreachable (``HF_HUB_OFFLINE=1`` with nothing cached, or no network), or not on the Hub, it is
one line saying what to do instead of ``datasets``' traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Hub ids whose dataset has no default config, and the config that is GSM8K's
DEFAULT_CONFIGS: dict[str, str] = {"openai/gsm8k": "main", "gsm8k": "main"}
_LOCAL_FORMS = "a local .jsonl/.jsonl.gz/.json/.parquet file, or a folder written by Dataset.save_to_disk"


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder ``save_to_disk`` wrote: a ``Dataset``'s (``state.json``) or a ``DatasetDict``'s
    (``dataset_dict.json``)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def dataset_rows(dataset: Any, split: str, described: str) -> list[dict[str, Any]]:
    """The rows of a loaded ``Dataset`` as dicts; of a ``DatasetDict`` (or any mapping of splits), its ``split``'s."""
    if isinstance(dataset, Mapping):
        if split not in dataset:
            raise ValueError(f"{described}: no split {split!r}; expected one of {sorted(dataset)}")
        dataset = dataset[split]
    return [dict(row) for row in dataset]


def read_saved(path: Path, split: str) -> list[dict[str, Any]]:
    """The rows of a ``save_to_disk`` folder (a ``DatasetDict``'s: its ``split``'s; a ``Dataset``'s: all)."""
    import datasets

    return dataset_rows(datasets.load_from_disk(str(path)), split, str(path))


def hub_config(source: str, config: str | None) -> str | None:
    """The config a Hub id is loaded with: ``config`` when given, else the dataset's default (``None``), GSM8K's
    ``main`` for GSM8K's own ids."""
    return config if config is not None else DEFAULT_CONFIGS.get(source)


def describe_hub(source: str, config: str | None, split: str) -> str:
    """A Hub dataset in words, for messages."""
    named = f"config {config!r}" if config is not None else "its default config"
    return f"{source} ({named}, split {split!r})"


def read_hub(source: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """The rows of a Hub dataset's ``split`` (:func:`dataset_rows`), or one line when it cannot be had."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    described = describe_hub(source, config, split)
    try:
        dataset = datasets.load_dataset(source, config, split=split)
    except ConnectionError as e:  # what datasets raises offline and without a network alike
        if datasets.config.HF_HUB_OFFLINE:
            raise ValueError(f"dataset {described} is not in the Hugging Face cache, and HF_HUB_OFFLINE=1 forbids "
                             f"downloading it; expected it cached (load it once with the network, without "
                             f"HF_HUB_OFFLINE) or {_LOCAL_FORMS}") from None
        raise ValueError(f"dataset {described}: the Hugging Face Hub cannot be reached ({_one_line(e)}); expected a "
                         f"network, a copy cached earlier, or {_LOCAL_FORMS}") from None
    except DatasetNotFoundError as e:
        raise ValueError(f"dataset {described}: {_one_line(e)}; expected a Hub dataset id (owner/name) or "
                         f"{_LOCAL_FORMS}") from None
    return dataset_rows(dataset, split, described)
