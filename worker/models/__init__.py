"""From a catalogue entry (shared/models.py ModelSpec) to a backend object, checked against the
contract (worker/backend.py ModelBackend) before anything is loaded, and the check of encoded
outputs against the entry's declared output. Built-in models and users' models go through the
same path: `ModelSpec.backend` is imported, whatever package it is in."""

from __future__ import annotations

import importlib
import inspect
from typing import cast

import numpy as np

from vramguard.shared.models import ModelSpec, OutputSpec
from vramguard.shared.settings import Settings
from vramguard.worker.backend import ModelBackend

# The contract's methods and the positional parameters each takes after self.
CONTRACT_METHODS: dict[str, int] = {
    "load": 0, "decode": 2, "item_cost": 1, "sample_item": 1, "collate": 1, "forward": 1, "split": 2,
    "encode": 2, "example_inputs": 0,
}
_JSON_SCALARS = (str, int, float, bool, type(None), np.ndarray, np.generic)


class BackendContractError(Exception):
    """A model's class cannot be imported, does not follow the contract, or returns what its entry
    does not declare. The worker exits ExitCode.MODEL_INVALID: restarting will not help."""


def import_backend_class(spec: ModelSpec) -> type:
    """The class named by `spec.backend` ("package.module:ClassName").

    Raises BackendContractError naming the model and the path when the module or the class is
    missing, or importing the module raises.
    """
    module_name, _, class_name = spec.backend.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise BackendContractError(
            f"model {spec.name!r}: cannot import module {module_name!r} of backend {spec.backend!r}: {exc} "
            "(is the package installed, or on PYTHONPATH?)") from exc
    except Exception as exc:  # noqa: BLE001 - any failure while importing user code is a start failure
        raise BackendContractError(
            f"model {spec.name!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise BackendContractError(f"model {spec.name!r}: module {module_name!r} has no class {class_name!r}")
    check_contract(spec, cls)
    return cls


def check_contract(spec: ModelSpec, cls: type) -> None:
    """Raise BackendContractError listing every contract method `cls` lacks or takes the wrong
    number of positional parameters in, and a missing `max_item_cost`."""
    problems = []
    for method, n_params in CONTRACT_METHODS.items():
        func = getattr(cls, method, None)
        if not callable(func):
            problems.append(f"no method {method}()")
            continue
        params = [p for p in list(inspect.signature(func).parameters.values())[1:]
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(params) != n_params:
            problems.append(f"{method}() takes {len(params)} parameters after self, the contract passes {n_params}")
    if not hasattr(cls, "max_item_cost"):
        problems.append("no max_item_cost (a property or attribute)")
    if problems:
        raise BackendContractError(
            f"model {spec.name!r}: {spec.backend} does not follow vramguard.ModelBackend: " + "; ".join(problems))


def create_backend(settings: Settings, device: str) -> ModelBackend:
    """An unloaded backend for `settings.model` on `device`.

    Raises BackendContractError (see import_backend_class), ValueError for params the model does
    not take (raised by its constructor).
    """
    spec = settings.spec_for(settings.model)
    cls = import_backend_class(spec)
    if device == "sim" and not getattr(cls, "simulates_memory", False):
        # A real model on the simulated GPU runs for real on the CPU; worker/memory/mirror.py mirrors
        # its tensors into the simulated allocator (installed at start by worker/memory/budget.py).
        device = "cpu"
    backend = cls(settings.model_config_for(settings.model), device, settings)
    if not isinstance(getattr(backend, "name", None), str) or not isinstance(getattr(backend, "device", None), str):
        raise BackendContractError(f"model {spec.name!r}: {spec.backend} instances need str attributes name and device")
    return cast(ModelBackend, backend)


def check_output(spec: ModelSpec, value: object) -> None:
    """Raise BackendContractError when one encoded output does not match `spec.output`."""
    problem = _output_problem(spec.output, value)
    if problem is not None:
        raise BackendContractError(
            f"model {spec.name!r}: encode() returned {problem}, but the catalogue entry declares "
            f"output {spec.output.model_dump(exclude_defaults=True)}")


def _output_problem(out: OutputSpec, value: object) -> str | None:
    if out.kind == "tensor":
        if not isinstance(value, np.ndarray):
            return f"a {type(value).__name__}, not a numpy array"
        assert out.datatype is not None and out.shape is not None
        if value.dtype != np.dtype(out.datatype):
            return f"dtype {value.dtype}"
        if len(value.shape) != len(out.shape) or any(
                d not in (-1, v) for d, v in zip(out.shape, value.shape, strict=True)):
            return f"shape {list(value.shape)}"
        return None
    if not _wire_value(value):
        return "a value that cannot travel on the wire (msgpack natives and numpy arrays only)"
    missing = [k for k in out.keys if not (isinstance(value, dict) and k in value)]
    return f"a value without the keys {missing}" if missing else None


def _wire_value(value: object) -> bool:
    if isinstance(value, _JSON_SCALARS):
        return True
    if isinstance(value, list | tuple):
        return all(_wire_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _wire_value(v) for k, v in value.items())
    return False
