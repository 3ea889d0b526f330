"""The engine's side of LoRA adapters: each model's ``AdapterStore`` (attached when ``max_loras`` > 0),
and the checks a request's ``SamplingParams.loras`` pass on their way in (``Engine.make_request`` /
``add_request``), each failing with an ``InvalidParamError`` that names the adapter and the choices."""

from __future__ import annotations

from ..config import EngineConfig
from ..errors import InvalidParamError
from ..families import Family


def attach_adapters(models: dict[str, Family], config: EngineConfig) -> None:
    """Give each model that takes LoRA adapters its store (``family.adapters``) when ``max_loras`` > 0."""
    from . import LOADERS, AdapterStore

    for family in models.values():
        family.adapters = None
        if config.max_loras and family.name in LOADERS:
            family.adapters = AdapterStore(family, config.max_loras, config.max_lora_rank)


def adapter_store(family: Family, name: str, asked=None):
    """Model ``name``'s adapter store; where it has none, ``InvalidParamError`` naming ``loras`` with
    ``asked`` (the adapter, or adapters, the caller wanted) and why: the engine's ``max_loras`` is 0 (the
    default), or the family takes no adapters."""
    store = getattr(family, "adapters", None)
    if store is None:
        from . import LOADERS

        why = ("max_loras=0 in this engine, the default: set max_loras=N (Engine.from_pretrained, EngineConfig; "
               "omnidit serve --max-loras N) to load adapters" if family.name in LOADERS
               else f"LoRA adapters are supported for {sorted(LOADERS)} models so far")
        raise InvalidParamError("loras", name if asked is None else asked,
                                f"a model that takes LoRA adapters (model {name!r}: {why})")
    return store


def pin_loras(family: Family, name: str, loras) -> None:
    """Check and hold a request's adapters at once (under the store's lock). An adapter unloaded since the
    request was checked (``make_request``, in another thread) is the request's ``InvalidParamError``."""
    from . import AdapterNotLoadedError

    store = adapter_store(family, name, [adapter for adapter, _ in loras])
    try:
        store.pin(loras)
    except AdapterNotLoadedError as e:
        leaving = " and not being unloaded" if store.is_retiring(e.name) else ""  # (AdapterStore.retire)
        usable = sorted(d["name"] for d in store.describe() if not store.is_retiring(d["name"]))
        raise InvalidParamError("loras", e.name, f"an adapter loaded for model {name!r}{leaving}: "
                                                 f"{usable or 'none loaded'}") from e


def check_loras(family: Family, name: str, loras) -> None:
    """Every adapter a request names is resident for its model."""
    store = adapter_store(family, name, [adapter for adapter, _ in loras])
    for adapter, _ in loras:
        if adapter not in store.adapters:
            raise InvalidParamError("loras", adapter, f"an adapter loaded for model {name!r}: "
                                                      f"{sorted(store.adapters) or 'none loaded'}")
