"""The quantization spec: ``METHOD[:TYPE][,components=a+b][,kernel=NAME]``.

Examples: ``int8-weight``, ``int8-dynamic``, ``fp8``, ``gguf:Q4_0``,
``int8-dynamic,components=transformer+text_encoder``, ``int8-weight,kernel=int8pack``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import QuantSpecError

DEFAULT_COMPONENTS = ("transformer",)


@dataclass(frozen=True)
class QuantSpec:
    method: str
    qtype: str | None = None  # the GGUF block type (Q8_0, Q4_K, ...) for ``gguf``
    components: tuple[str, ...] = DEFAULT_COMPONENTS
    kernel: str | None = None  # None: the method's default kernel for the device

    def __str__(self) -> str:
        text = self.method + (f":{self.qtype}" if self.qtype else "")
        if self.components != DEFAULT_COMPONENTS:
            text += ",components=" + "+".join(self.components)
        if self.kernel:
            text += f",kernel={self.kernel}"
        return text


def parse_spec(text: "str | QuantSpec") -> QuantSpec:
    """Parse and validate a spec against the method registry; raises QuantSpecError naming what is wrong."""
    from .registry import METHODS

    if isinstance(text, QuantSpec):
        text = str(text)
    if not isinstance(text, str) or not text.strip():
        raise QuantSpecError(text, "expected a non-empty string")
    head, *options = [part.strip() for part in text.split(",")]
    name, _, qtype = head.partition(":")
    name = name.lower()
    if name not in METHODS:
        raise QuantSpecError(text, f"unknown method {name!r}")
    method = METHODS[name]
    qtype = qtype.upper() or None
    if method.qtypes and qtype not in method.qtypes:
        said = f"has no type {qtype!r}" if qtype else "needs a type"
        raise QuantSpecError(text, f"{name} {said}: one of {[f'{name}:{t}' for t in method.qtypes]}")
    if not method.qtypes and qtype:
        raise QuantSpecError(text, f"{name} takes no ':TYPE' (got {qtype!r})")
    fields = {"components": DEFAULT_COMPONENTS, "kernel": None}
    for option in options:
        key, eq, value = option.partition("=")
        if not eq or key not in fields or not value:
            raise QuantSpecError(text, f"bad option {option!r}; options: components=NAME[+NAME...], "
                                       f"kernel=NAME")
        fields[key] = tuple(value.split("+")) if key == "components" else value
    if fields["kernel"] is not None and fields["kernel"] not in method.all_kernels():
        raise QuantSpecError(text, f"{name} has no kernel {fields['kernel']!r}; kernels: {method.all_kernels()}")
    return QuantSpec(name, qtype, fields["components"], fields["kernel"])


def allowed() -> list[str]:
    """Every accepted ``METHOD[:TYPE]``, for error messages and --help."""
    from .registry import METHODS

    out = []
    for m in METHODS.values():
        out += [f"{m.name}:{t}" for t in m.qtypes] if m.qtypes else [m.name]
    return out
