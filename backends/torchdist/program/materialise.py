"""The model built without parameter storage, and the values of only this rank's tensors: the init contract.

No rank ever holds the whole model: it is built with its parameters on the meta device, traced and split
there, and a rank then gives values to the tensors its own stage reads, module by module, on CPU, and
moves them to its device. Their values follow one contract, which backends/torchdist/reference.py
follows too, so that one process reproduces every stage of every plan for the same seed:

1. `torch.manual_seed(seed)`, then `model()` runs with each parameter moved to the meta device as it is
   registered. Buffers keep the values the constructor gave them (running statistics, rotary tables,
   masks: small, and often computed in `__init__` in ways nothing else can redo).
2. Each module that holds parameters directly, in the order of `model.named_modules()`, initialises them
   under the default generator seeded from (seed, its qualified name) (`module_seed`):
   - first the values its constructor gave them when its class has no `reset_parameters` (a norm's
     `torch.ones`), otherwise its `reset_parameters()` (`_reset_parameters()` for MultiheadAttention);
   - then the model file's `init_weights(module)` when the file defines one, or else, for a module inside a
     Hugging Face model (a `transformers` PreTrainedModel), that model's `_init_weights(module)`: the
     initialisation `from_config` gives it.
   An init sets the module's own direct parameters only; a parameter several modules share (tied
   weights) ends with the value the last of them gives it.
3. The values are made on CPU whatever the rank's device, so they depend on neither device nor plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from planner import frontend
from planner.core.errors import ModelFileError
from planner.frontend.user_code import user_code

from .seeds import derived_seed

INIT_WEIGHTS = "init_weights"     # the model file's optional per-module initialiser


def module_seed(seed: int, qualified_name: str) -> int:
    """The generator seed of one module's initialisation: a hash of the run's seed and the module's name."""
    return derived_seed(f"{seed}:{qualified_name}")


def _torch_reset(module: nn.Module) -> Callable[[], None] | None:
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


@dataclass
class MetaModel:
    """The model with every parameter and buffer on meta, and what the contract needs to give them values."""

    module: nn.Module
    seed: int
    buffers: dict[str, torch.Tensor]              # qualified name -> the constructor's value (CPU)
    constructed: dict[int, torch.Tensor]          # id(meta parameter) -> the constructor's value, for modules
    init_weights: Callable[[nn.Module], object] | None = None          # without reset_parameters
    _holders: dict[int, list[tuple[str, str]]] = field(default_factory=dict)

    def holders(self, param: nn.Parameter) -> list[tuple[str, str]]:
        """(module name, attribute) of every module holding `param` directly, in named_modules order."""
        if not self._holders:
            for mname, mod in self.module.named_modules():
                for attr, p in mod._parameters.items():
                    if p is not None:
                        self._holders.setdefault(id(p), []).append((mname, attr))
        return self._holders.get(id(param), [])


@contextlib.contextmanager
def _parameters_on_meta(constructed: dict[int, torch.Tensor]) -> Iterator[None]:
    """While the model is built: every parameter registered moves to meta; the constructor's value is kept
    for modules without reset_parameters (their only definition of an initial value)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            if _torch_reset(module) is None:
                constructed[id(meta)] = param.detach()
            param = meta
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_meta(model_file: frontend.ModelFile, seed: int) -> MetaModel:
    """Step 1 of the contract: the model built with parameters on meta, buffers moved there after their
    constructed values are kept."""
    constructed: dict[int, torch.Tensor] = {}
    file = str(model_file.path)
    torch.manual_seed(seed)
    try:
        with user_code(file, "model()", model_file.time_limit_s, field="model"), _parameters_on_meta(constructed):
            module = model_file.build()
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(f"model() failed: {type(exc).__name__}: {exc}", file=file, field="model",
                             fix="make `model()` build the model on CPU with torch.nn") from exc
    buffers: dict[str, torch.Tensor] = {}
    for mname, mod in module.named_modules():
        for bname, buf in list(mod._buffers.items()):
            if buf is not None:
                buffers.setdefault(f"{mname}.{bname}" if mname else bname, buf)
                mod._buffers[bname] = buf.to("meta")
    init_weights = getattr(model_file.module, INIT_WEIGHTS, None)
    return MetaModel(module, seed, buffers, constructed, init_weights if callable(init_weights) else None)


def is_hf_model(module: nn.Module) -> bool:
    """A Hugging Face model (a `transformers` PreTrainedModel), known without importing transformers."""
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


def _hf_initialiser(meta: MetaModel) -> dict[str, Callable[[nn.Module], object]]:
    """module name -> the `_init_weights` of the innermost Hugging Face model containing it."""
    out: dict[str, Callable[[nn.Module], object]] = {}
    for mname, mod in meta.module.named_modules():
        fn = getattr(mod, "_init_weights", None)
        if callable(fn) and is_hf_model(mod):
            prefix = f"{mname}." if mname else ""
            for sub, _ in mod.named_modules():
                out[prefix + sub if sub else mname] = fn   # inner models come later: they win
    return out


def _modules_to_init(meta: MetaModel, params: Iterable[nn.Parameter]) -> set[str]:
    """The modules holding any of `params`, closed over sharing: a module's init sets all its direct
    parameters, so every other holder of one of those must run too for the last-wins rule to hold."""
    todo = list(params)
    seen_params: set[int] = set()
    modules: set[str] = set()
    while todo:
        p = todo.pop()
        if id(p) in seen_params:
            continue
        seen_params.add(id(p))
        for mname, _ in meta.holders(p):
            if mname not in modules:
                modules.add(mname)
                todo += [q for q in meta.module.get_submodule(mname)._parameters.values() if q is not None]
    return modules


def materialise(meta: MetaModel, names: Iterable[str], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Steps 2-3 of the contract for the tensors `names` (qualified parameter or buffer names, any alias of
    a tied parameter): name -> its value on `device`; parameters as nn.Parameter, one object per shared
    parameter. The meta model is left as it was (it stays traceable)."""
    wanted = list(dict.fromkeys(names))
    params: dict[str, nn.Parameter] = {}
    for name in wanted:
        if name not in meta.buffers:
            params[name] = meta.module.get_parameter(name)
    real = _initialised(meta, _modules_to_init(meta, params.values()))
    out: dict[str, torch.Tensor] = {}
    moved: dict[int, torch.Tensor] = {}
    for name in wanted:
        if name in meta.buffers:
            out[name] = meta.buffers[name].to(device, copy=True)
            continue
        p = params[name]
        if id(p) not in moved:
            moved[id(p)] = nn.Parameter(real[id(p)].to(device), requires_grad=p.requires_grad)
        out[name] = moved[id(p)]
    return out


def _initialised(meta: MetaModel, module_names: set[str]) -> dict[int, torch.Tensor]:
    """id(meta parameter) -> its CPU value, for every direct parameter of `module_names`, initialised in
    named_modules order. Each module's parameters are swapped in for its init and swapped back after."""
    hf = _hf_initialiser(meta) if meta.init_weights is None else {}
    real: dict[int, torch.Tensor] = {}
    for mname, mod in meta.module.named_modules():
        if mname not in module_names:
            continue
        originals = dict(mod._parameters)
        for p in originals.values():
            if p is not None and id(p) not in real:
                made = meta.constructed.get(id(p))
                real[id(p)] = (made.clone() if made is not None
                               else torch.empty(p.shape, dtype=p.dtype, device="cpu"))
        try:
            for attr, p in originals.items():
                if p is not None:
                    mod._parameters[attr] = nn.Parameter(real[id(p)], requires_grad=p.requires_grad)
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(module_seed(meta.seed, mname))
                reset = _torch_reset(mod)
                if reset is not None:
                    reset()
                extra = meta.init_weights or hf.get(mname)
                if extra is not None:
                    extra(mod)
        finally:
            for attr, p in originals.items():
                if p is not None:
                    real[id(p)] = mod._parameters[attr].data   # an init may have replaced the tensor
                mod._parameters[attr] = p
    return real


def full_model(model_file: frontend.ModelFile, seed: int) -> nn.Module:
    """The whole model on CPU with the contract's values: what one process trains (reference.py)."""
    meta = build_meta(model_file, seed)
    names = [n for n, _ in meta.module.named_parameters()] + list(meta.buffers)
    values = materialise(meta, names, "cpu")
    install(meta.module, values)
    return meta.module


def install(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Put `values` (qualified name -> tensor, from `materialise`) into `module` in place of its meta
    tensors, at every path that refers to the same tensor (tied parameters stay tied)."""
    by_id: dict[int, torch.Tensor] = {}
    for name, value in values.items():
        prefix, _, attr = name.rpartition(".")
        owner = module.get_submodule(prefix)
        old = owner._parameters.get(attr) if attr in owner._parameters else owner._buffers.get(attr)
        if old is not None:
            by_id[id(old)] = value
    for mod in module.modules():
        for attr, p in list(mod._parameters.items()):
            if p is not None and id(p) in by_id:
                mod._parameters[attr] = by_id[id(p)]  # type: ignore[assignment]
        for attr, b in list(mod._buffers.items()):
            if b is not None and id(b) in by_id:
                mod._buffers[attr] = by_id[id(b)]
