"""Finding the layer to hook in a PyTorch / Hugging Face model, and reading/replacing its output.

Hugging Face decoder blocks return a tensor (transformers 5) or a tuple whose first element is the
hidden state (transformers 4); some modules return a ``ModelOutput`` with ``last_hidden_state``.
The hook only ever touches that hidden-state tensor and hands everything else back unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["find_last_block", "resolve_layer", "split_output"]

# Where the decoder blocks of common Hugging Face causal LMs live, most specific first.
_KNOWN_BLOCK_LISTS = (
    "transformer.h",  # GPT-2, GPT-J, Bloom, Falcon
    "model.layers",  # Llama, Mistral, Qwen2, Gemma, Phi-3
    "gpt_neox.layers",  # Pythia / GPT-NeoX
    "model.decoder.layers",  # OPT
    "transformer.blocks",  # MPT
    "transformer.layers",
    "model.transformer.h",
)
# Fallback: the last ModuleList whose own name is one of these (also inside PEFT wrappers).
_BLOCK_LIST_NAMES = ("h", "layers", "layer", "blocks")


def find_last_block(model: nn.Module) -> tuple[str, nn.Module]:
    """The last transformer block of a Hugging Face style model, found by name.

    Returns:
        ``(path, module)``, e.g. ``("transformer.h.1", GPT2Block(...))``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        LookupError: no list of blocks was found; pass ``layer=`` explicitly (a path or a module).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got model={type(model).__name__}")
    for path in _KNOWN_BLOCK_LISTS:
        try:
            blocks = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            return f"{path}.{len(blocks) - 1}", blocks[-1]
    found: tuple[str, nn.Module] | None = None
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) > 0
            and name.rsplit(".", 1)[-1] in _BLOCK_LIST_NAMES
        ):
            found = (f"{name}.{len(module) - 1}", module[-1])
    if found is None:
        raise LookupError(
            f"found no transformer blocks in {type(model).__name__} (looked for "
            f"{', '.join(_KNOWN_BLOCK_LISTS)}); pass layer= as a module path string or a module"
        )
    return found


def resolve_layer(model: nn.Module | None, layer: str | int | nn.Module | None) -> tuple[str, nn.Module]:
    """Turn ``layer`` (None, a block index, a module path or a module) into ``(path, module)``.

    ``None`` is the last transformer block; an ``int`` indexes the list of blocks (negative counts
    from the end); a string is a path as in ``model.get_submodule`` (``"model.layers.3"``).
    """
    if isinstance(layer, nn.Module):
        if model is not None:
            for name, module in model.named_modules():
                if module is layer:
                    return name, module
            raise LookupError(f"layer {type(layer).__name__} is not a submodule of model")
        return type(layer).__name__, layer
    if model is None:
        raise TypeError("layer must be an nn.Module when model is None")
    if layer is None:
        return find_last_block(model)
    if isinstance(layer, bool):
        raise TypeError(f"layer must be None, an int, a module path or a module, got layer={layer!r}")
    if isinstance(layer, int):
        path, _ = find_last_block(model)
        list_path = path.rsplit(".", 1)[0]
        blocks = model.get_submodule(list_path)
        if not isinstance(blocks, nn.ModuleList):
            raise TypeError(
                f"layer={layer} is an index, but the model's blocks at {list_path!r} are a "
                f"{type(blocks).__name__}, not an nn.ModuleList: give a module path or a module"
            )
        try:
            module = blocks[layer]
        except IndexError:
            raise LookupError(f"layer={layer} is out of range for {len(blocks)} blocks") from None
        return f"{list_path}.{layer % len(blocks)}", module
    if isinstance(layer, str):
        try:
            return layer, model.get_submodule(layer)
        except AttributeError:
            raise LookupError(f"model has no submodule layer={layer!r}") from None
    raise TypeError(f"layer must be None, an int, a module path or a module, got layer={layer!r}")


def split_output(output: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """The hidden-state tensor inside a module's output, and a function that puts a new one back.

    Handles a tensor, a tuple or list whose first element is the tensor (Hugging Face blocks in
    transformers 4), and a mapping / ``ModelOutput`` with ``last_hidden_state``.

    Raises:
        TypeError: no hidden-state tensor was found (nothing is released then).
    """
    if isinstance(output, torch.Tensor):
        return output, lambda h: h
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        rest = output[1:]
        return output[0], lambda h: (h, *rest)
    if isinstance(output, list) and output and isinstance(output[0], torch.Tensor):
        rest_list = output[1:]
        return output[0], lambda h: [h, *rest_list]
    if isinstance(output, Mapping) and isinstance(output.get("last_hidden_state"), torch.Tensor):

        def put_back(h: torch.Tensor) -> Any:
            output["last_hidden_state"] = h  # type: ignore[index]
            return output

        return output["last_hidden_state"], put_back
    raise TypeError(
        f"the hooked layer returned {type(output).__name__}; expected a tensor, a tuple whose first "
        "element is the hidden-state tensor, or a mapping with 'last_hidden_state'"
    )
