"""The Python API's keyword checks: a keyword a call does not take is a TypeError, as Python makes it, that
says what was meant (a misspelt engine option, or a ``SamplingParams`` field given to ``generate``)."""

from __future__ import annotations

import dataclasses
import difflib

from .config import EngineConfig
from .params import SamplingParams


def check_no_params_fields(method: str, misplaced: dict) -> None:
    """Keywords a generate call does not take: a TypeError, as for any unknown keyword, that says where a
    ``SamplingParams`` field goes (``generate(prompt, SamplingParams(image=img, strength=0.6))``)."""
    if not misplaced:
        return
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    name = next(iter(misplaced))
    if name in fields:
        raise TypeError(f"{method}() takes no {name!r}: it is a SamplingParams field, e.g. "
                        f"{method}(prompt, SamplingParams({name}=..., ...))")
    raise TypeError(f"{method}() got an unexpected keyword argument {name!r}")


def check_option_names(options: dict) -> None:
    """A misspelt engine option is a TypeError (as for any unknown keyword) that says what was meant."""
    known = [f.name for f in dataclasses.fields(EngineConfig)]
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; the options are EngineConfig's fields"
            raise TypeError(f"unknown engine option {name!r}{hint} (docs/reference/configuration.md)")
