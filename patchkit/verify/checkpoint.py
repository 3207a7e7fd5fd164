"""The base model directory a LoRA adapter is merged into, read from its headers only.

vLLM loads every tensor of every ``*.safetensors`` file the index names,
so the checkpoint is its shards (each header read and checked, no tensor
bytes), which shard holds each tensor, the index's metadata and
config.json. A weight file name from the index never leads outside the
model directory, and a tensor in two shards is refused. ``user_json`` is
how the merge reads every JSON file of a model or an adapter: capped, one
line naming the file when it is not a JSON object.
"""

from __future__ import annotations

import os
from pathlib import Path

from patchkit.adapters.safetensorsfile import MANIFEST_BYTES, SafetensorsFile, TensorInfo, shown
from patchkit.codes import Code
from patchkit.errors import FileProblem, OsFailure, PatchkitError
from patchkit.fs.files import read_user_json
from patchkit.fs.safepath import UnsafePath

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# adapter_config.json and config.json: PEFT's and transformers' are a few kB,
# a rank_pattern naming every module of a large model tens of kB.
CONFIG_BYTES = 1 << 20


def user_json(path: Path, limit: int, what: str) -> dict:
    """A JSON object from a model or adapter file, or one line naming the file."""
    try:
        data = read_user_json(path, limit)
    except OSError as exc:
        raise OsFailure(exc, "reading") from None
    except ValueError as exc:
        raise FileProblem(path, f"unusable as {what}: {exc}") from None
    if not isinstance(data, dict):
        raise FileProblem(path, f"not a JSON object ({what} expected)")
    return data


def _safe_relname(name: str, where: Path) -> str:
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise UnsafePath(
            f"{where}: refuses weight file name {shown(name)} outside the model directory",
            path=name,
            origin=where,
        )
    return name


class CheckpointInvalid(PatchkitError):
    """A base model directory that is no safetensors checkpoint the merge reads (none
    there, an index that names what is not there, a tensor in two shards, experts of a
    layout it does not merge): ``path`` names the directory or the file."""

    code = Code.CHECKPOINT_INVALID


class Checkpoint:
    """The base model directory: shards (headers only), index, config."""

    def __init__(self, model_dir: Path):
        self.dir = model_dir
        if not model_dir.is_dir():
            raise CheckpointInvalid(f"model directory {model_dir} does not exist", path=model_dir)
        index = model_dir / INDEX_NAME
        self.index_meta: dict | None = None
        if index.is_file():
            data = user_json(index, MANIFEST_BYTES, "a safetensors index")
            weight_map, meta = data.get("weight_map"), data.get("metadata") or {}
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()
            ):
                raise CheckpointInvalid(
                    f"{index}: weight_map is not a JSON object of tensor name to file name",
                    path=index,
                )
            if not isinstance(meta, dict):
                raise CheckpointInvalid(f"{index}: metadata is not a JSON object", path=index)
            self.index_meta = dict(meta)
            names = sorted({_safe_relname(v, index) for v in weight_map.values()})
        elif (model_dir / SINGLE_NAME).is_file():
            names = [SINGLE_NAME]
        else:
            names = sorted(p.name for p in model_dir.glob("*.safetensors"))
            if not names:
                raise CheckpointInvalid(
                    f"{model_dir} holds no safetensors weights (model.safetensors or "
                    f"{INDEX_NAME}); the merge needs a safetensors checkpoint",
                    path=model_dir,
                )
        self.shards: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        for name in names:
            path = model_dir / name
            if not path.is_file():
                if not index.is_file():  # a FIFO or a dangling link found by the glob
                    raise CheckpointInvalid(
                        f"{path}: not a regular file (a weight file expected)", path=path
                    )
                raise CheckpointInvalid(
                    f"{index}: names {shown(name)}, which is not in {model_dir}", path=index
                )
            shard = SafetensorsFile(path)
            self.shards[name] = shard
            for key in shard.tensors:
                if key in self.where:
                    raise CheckpointInvalid(
                        f"{model_dir}: tensor {key} is in both {self.where[key]} and {name}",
                        path=model_dir,
                    )
                self.where[key] = name
        self.config: dict = {}
        config = model_dir / "config.json"
        if config.is_file():
            self.config = user_json(config, CONFIG_BYTES, "a model config")

    def info(self, key: str) -> TensorInfo:
        return self.shards[self.where[key]].tensors[key]

    def has(self, key: str) -> bool:
        return key in self.where

    def tied_embeddings(self) -> bool:
        text = self.config.get("text_config")
        text = text if isinstance(text, dict) else {}
        return bool(self.config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))

    def architecture(self) -> str:
        archs = self.config.get("architectures")
        first = archs[0] if isinstance(archs, list) and archs else ""
        return first if isinstance(first, str) else ""

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()
