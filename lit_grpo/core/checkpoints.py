"""Reading Lightning checkpoints of a `GRPOModule` in one process, without a Trainer or a process group.

Two layouts:

- one file (``*.ckpt``), as written in one process and by DDP or FSDP with full state dicts: ``torch.save`` of
  a dict holding ``state_dict`` (keys ``policy.<hf name>`` and ``reference.<hf name>``), ``optimizer_states``,
  ``hyper_parameters`` and the loops' and callbacks' state;
- a directory, as written by Lightning's ``ModelParallelStrategy`` (FSDP2): the tensors of ``state_dict`` and of
  each ``optimizer_<i>`` as torch.distributed.checkpoint (DCP) shards, everything else in ``meta.pt``
  (``FSDPStrategy(state_dict_type="sharded")`` writes the same layout with the model's entry named ``model``).

Only the tensors asked for are read: exporting a policy never materialises the reference or the optimizer
state. Every problem is a :class:`CheckpointError` (a ``ValueError``) whose one-line message names the path and
the reason.
"""

from __future__ import annotations

import pickle
import warnings
import zipfile
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

META_FILE = "meta.pt"  # the name Lightning gives the non-tensor part of a sharded checkpoint (_METADATA_FILENAME)
DCP_METADATA = ".metadata"  # written by torch.distributed.checkpoint next to its shards


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a sharded (DCP) checkpoint directory, by Lightning's own test: a directory with meta.pt."""
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file()


def _first_line(err: BaseException) -> str:
    """The informative line of a library error (torch's messages run over several lines and paragraphs)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("WeightsUnpickler error:"):
            return line.removeprefix("WeightsUnpickler error:").strip()
    text = lines[0] if lines else type(err).__name__
    return text.split(". ")[0].rstrip(".")


def _torch_load(path: Path, what: str) -> Any:
    """``torch.load`` of a file that may be truncated, empty or something else entirely."""
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is an empty file")
    if not zipfile.is_zipfile(path):
        # torch.save writes a zip archive; a copy cut short loses the archive's directory at its end
        raise CheckpointError(f"checkpoint {path} is not a torch.save archive: truncated, or not a checkpoint at all")
    try:
        # mmap: tensors are read when used, so opening a multi-GB checkpoint costs next to nothing;
        # weights_only: a checkpoint is data, and loading it must not run code (Lightning loads it the same way)
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{what} {path} holds objects torch.load(weights_only=True) refuses ({_first_line(err)})"
        ) from err
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"{what} {path} cannot be read: {_first_line(err)}") from err


class Checkpoint:
    """An opened checkpoint: its non-tensor part at once, its model tensors on demand.

    ``Checkpoint(path)`` checks that the file or directory is a readable Lightning checkpoint with a
    ``state_dict``; it raises :class:`CheckpointError` otherwise.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise CheckpointError(f"checkpoint {self.path} does not exist")
        self.sharded = self.path.is_dir()
        if self.sharded:
            self._open_directory()
        else:
            self._open_file()

    def _open_file(self) -> None:
        ckpt = _torch_load(self.path, "checkpoint")
        if not isinstance(ckpt, Mapping) or not isinstance(ckpt.get("state_dict"), Mapping):
            found = sorted(map(str, ckpt))[:6] if isinstance(ckpt, Mapping) else type(ckpt).__name__
            raise CheckpointError(
                f"checkpoint {self.path} is not a Lightning checkpoint: expected a dict with a 'state_dict', "
                f"found {found}"
            )
        self._state: Mapping[str, Any] = ckpt["state_dict"]
        self.meta = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}

    def _open_directory(self) -> None:
        if not (self.path / META_FILE).is_file():
            raise CheckpointError(
                f"checkpoint {self.path} is a directory without {META_FILE}: expected a .ckpt file or a sharded "
                "checkpoint directory written by ModelParallelStrategy"
            )
        meta = _torch_load(self.path / META_FILE, "checkpoint metadata")
        if not isinstance(meta, Mapping):
            raise CheckpointError(f"checkpoint metadata {self.path / META_FILE} is a {type(meta).__name__}, not a dict")
        self.meta = dict(meta)
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        try:
            metadata = FileSystemReader(str(self.path)).read_metadata()
        except Exception as err:  # noqa: BLE001 - the reader raises whatever its file system or unpickler raises
            raise CheckpointError(
                f"checkpoint {self.path}: its DCP shard index {DCP_METADATA} cannot be read ({_first_line(err)})"
            ) from err
        # DCP flattens nested dicts with dots: {"state_dict": {"policy.x": t}} is stored as "state_dict.policy.x".
        # ModelParallelStrategy (FSDP2) names the model's entry "state_dict", FSDPStrategy's sharded format "model".
        for root in ("state_dict", "model"):
            self._root = root
            self._dcp = {
                key.removeprefix(f"{root}."): item
                for key, item in metadata.state_dict_metadata.items()
                if key.startswith(f"{root}.") and isinstance(item, TensorStorageMetadata)
            }
            if self._dcp:
                break
        else:
            raise CheckpointError(f"checkpoint {self.path} holds no 'state_dict' tensors in its DCP shards")

    @property
    def hyper_parameters(self) -> dict[str, Any]:
        hp = self.meta.get("hyper_parameters")
        return dict(hp) if isinstance(hp, Mapping) else {}

    def shapes(self, prefix: str = "") -> dict[str, torch.Size]:
        """Shapes of the ``state_dict`` tensors whose key starts with ``prefix``, by key without it."""
        if self.sharded:
            items = ((key, item.size) for key, item in self._dcp.items())
        else:
            items = ((key, value.shape) for key, value in self._state.items() if isinstance(value, torch.Tensor))
        return {key[len(prefix) :]: torch.Size(shape) for key, shape in items if key.startswith(prefix)}

    def check_fits(self, expected: Mapping[str, torch.Tensor], prefix: str = "", strict: bool = True,
                   optional: Collection[str] = ()) -> None:
        """Raise :class:`CheckpointError` unless the tensors under ``prefix`` have the keys and shapes of
        ``expected`` (a model's ``state_dict()``). ``strict=False`` allows missing and extra keys, as Lightning's
        ``strict_loading=False`` does; names in ``optional`` (tied aliases of another tensor) may be missing."""
        have = self.shapes(prefix)
        for key, tensor in expected.items():
            if key in have and have[key] != tensor.shape:
                raise self._mismatch(
                    f"{prefix}{key} has shape {list(have[key])} in the checkpoint and {list(tensor.shape)} in the model"
                )
        if not strict:
            return
        missing = [k for k in expected if k not in have and k not in optional]
        unexpected = [k for k in have if k not in expected]
        if missing:
            raise self._mismatch(
                f"{len(missing)} tensor(s) of the model are missing from it, e.g. {prefix}{missing[0]}"
            )
        if unexpected:
            raise self._mismatch(
                f"it holds {len(unexpected)} tensor(s) the model does not have, e.g. {prefix}{unexpected[0]}"
            )

    def _mismatch(self, detail: str) -> CheckpointError:
        trained = self.hyper_parameters.get("model_name")
        hint = f"; it was written for model_name={trained!r}" if trained else ""
        return CheckpointError(f"checkpoint {self.path} does not fit the model: {detail}{hint}")

    def tensors(self, prefix: str, like: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The ``state_dict`` tensors under ``prefix``, by key without it, on the CPU. For a sharded checkpoint
        only these are read from the shards (in the dtype they were saved in); ``like`` restricts the keys."""
        shapes = self.shapes(prefix)
        keys = [k for k in shapes if like is None or k in like]
        if not self.sharded:
            return {key: self._state[prefix + key] for key in keys}
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint import load as dcp_load

        out = {prefix + key: torch.empty(shapes[key], dtype=self._dcp[prefix + key].properties.dtype) for key in keys}
        try:
            with warnings.catch_warnings():
                # no process group on purpose: one process reads every shard
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                dcp_load({self._root: out}, storage_reader=FileSystemReader(str(self.path)), no_dist=True)
        except Exception as err:  # noqa: BLE001 - a missing or cut-short shard surfaces as many error types
            raise CheckpointError(
                f"checkpoint {self.path}: its DCP shards cannot be read ({_first_line(err)})"
            ) from err
        return {key[len(prefix) :]: value for key, value in out.items()}
