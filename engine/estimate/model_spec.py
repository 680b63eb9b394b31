"""A model named on the command line (`module:factory` or a Hugging Face config file), built on a device.

On the meta device nothing is allocated: the estimate reads shapes and traces a step; `tiers tune`
builds the same model on the real device for its trials.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Callable

import torch
from torch import nn


class ModelSpecError(ValueError):
    """The SPEC names no model that can be built; the message says why and what to give instead."""


def model_factory(spec: str) -> Callable[[], nn.Module]:
    """A no-argument callable building the model SPEC names: `package.module:factory` (a function or class
    called without arguments), or the path of a Hugging Face config.json (or a directory holding one)."""
    if os.path.isdir(spec) or spec.endswith(".json"):
        return _hugging_face_factory(spec)
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ModelSpecError(f"model {spec!r}: give `package.module:factory` (e.g. engine.models:gpt_small) or the "
                             "path of a Hugging Face config.json")
    if os.getcwd() not in sys.path:  # a user's own module next to their config, as `python -m` would find it
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelSpecError(f"model {spec!r}: cannot import {module_name!r} ({e}); check the module path and "
                             "that it imports from the current directory") from e
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ModelSpecError(f"model {spec!r}: {module_name} has no callable {attribute!r}; name a function or class "
                             "that builds the model without arguments")
    return factory


def _hugging_face_factory(path: str) -> Callable[[], nn.Module]:
    if not os.path.exists(path):
        raise ModelSpecError(f"model {path!r}: no such file or directory")
    try:
        import transformers
    except ImportError as e:
        raise ModelSpecError(f"model {path!r}: a Hugging Face config needs the transformers package "
                             "(pip install transformers, or the extra .[hf])") from e
    try:
        transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise ModelSpecError(f"model {path!r}: not a Hugging Face model config ({e})") from e
    return HuggingFaceFactory(os.path.abspath(path))


class HuggingFaceFactory:
    """Builds the model of a Hugging Face config file (a class, not a closure: `tiers tune` sends it to the
    processes it spawns, which pickles it)."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self) -> nn.Module:
        import transformers

        config = transformers.AutoConfig.from_pretrained(self.path)
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM: the bare model
            return transformers.AutoModel.from_config(config)


def build_model(factory: Callable[[], nn.Module], device: torch.device | str) -> nn.Module:
    """The model built by `factory` with every tensor created on `device` (meta: no memory at all)."""
    with torch.device(device):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    wanted = torch.device(device).type
    stray = {name: t.device for name, t in tensors.items() if t.device.type != wanted}
    if stray:
        name, where = next(iter(stray.items()))
        raise ModelSpecError(f"the model factory put {name!r} on {where} instead of {wanted}; create tensors without "
                             "an explicit device so that `with torch.device(...)` places them")
    return model
