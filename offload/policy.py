"""Offload policies: what lives in the slower tier, and how many transformer blocks are held.

Spec grammar (``EngineConfig.offload`` / ``--offload``): comma-separated parts,

* ``none``: every weight stays on the device (the default);
* ``components``: text encoders, the transformers thinker and the VAE live in host memory
  (pinned on CUDA) and come to the device for their own calls;
* ``blocks[:N]``: the transformer's blocks live in host memory; N blocks are loaded ahead of
  the one computing (so at most N + 1 are on the device); ``blocks:all`` keeps every block
  once loaded;
* ``disk[:N]``: as ``blocks`` with the checkpoint's safetensors files as the slower tier, so
  only N + 1 blocks are in memory at any time (on CPU with the file's dtype, the running part
  of one block: the N ahead are read into the page cache, not the process; see
  ``offload.streamer``).

``components`` combines with one of ``blocks`` / ``disk`` (``components,disk:1``). Without
N, N comes from the memory budget (``max_resident_gb``) when one is given, else 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import OffloadConfigError

TIERS = {"blocks": "host", "disk": "disk"}
PARTS = ("none", "components", "blocks", "disk")
EXAMPLES = "'none', 'components', 'blocks:2', 'disk:1', 'blocks:all' or 'components,disk:1'"


@dataclass(frozen=True)
class OffloadPolicy:
    """A parsed offload spec. ``tier``: where transformer blocks stream from (``host``,
    ``disk``) or None; ``ahead``: blocks loaded ahead of the computing one (None: not given);
    ``keep_all``: blocks stay once loaded (``:all``)."""

    components: bool = False
    tier: str | None = None
    ahead: int | None = None
    keep_all: bool = False

    @classmethod
    def parse(cls, spec: "str | OffloadPolicy | None") -> "OffloadPolicy":
        if spec is None or isinstance(spec, OffloadPolicy):
            return spec or cls()
        if not isinstance(spec, str):
            raise OffloadConfigError("offload", spec, f"a string such as {EXAMPLES}")
        parts = [p.strip() for p in spec.split(",") if p.strip()] or ["none"]
        values: dict = {}
        for part in parts:
            name, colon, arg = part.partition(":")
            if name not in PARTS:
                raise OffloadConfigError("offload", spec, f"parts among {list(PARTS)}, e.g. {EXAMPLES}")
            if name == "none":
                if len(parts) > 1:
                    raise OffloadConfigError("offload", spec, "'none' alone")
                continue
            if name == "components":
                if colon:
                    raise OffloadConfigError("offload", spec, "'components' without an argument")
                values["components"] = True
                continue
            if "tier" in values:
                raise OffloadConfigError("offload", spec, "at most one of 'blocks' and 'disk'")
            values["tier"] = TIERS[name]
            if arg == "all":
                values["keep_all"] = True
            elif colon:
                try:
                    values["ahead"] = int(arg)
                except ValueError:
                    values["ahead"] = 0
                if values["ahead"] < 1:
                    raise OffloadConfigError("offload", spec, f"{name}:N with an integer N >= 1, or {name}:all")
        return cls(**values)

    @property
    def streams_blocks(self) -> bool:
        return self.tier is not None

    def with_budget(self, device_type: str) -> "OffloadPolicy":
        """The policy a memory budget implies: with no block tier chosen, the tier that saves
        memory on ``device_type`` (the disk on CPU, where host memory is the device's)."""
        if self.tier is not None:
            return self
        return OffloadPolicy(self.components, "disk" if device_type == "cpu" else "host", None, False)

    def __str__(self) -> str:
        parts = ["components"] if self.components else []
        if self.tier is not None:
            name = "blocks" if self.tier == "host" else "disk"
            parts.append(f"{name}:all" if self.keep_all else name if self.ahead is None else f"{name}:{self.ahead}")
        return ",".join(parts) or "none"


def check_budget(value) -> float | None:
    """Validate ``max_resident_gb`` (GiB of weights kept on the device; None: no budget)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise OffloadConfigError("max_resident_gb", value, "a number of GiB > 0, or None")
    return float(value)


def blocks_for_budget(budget_gb: float, fixed_bytes: int, block_bytes: list[int]) -> tuple[int, bool]:
    """(ahead, keep_all) that keeps ``fixed_bytes`` plus the held blocks within ``budget_gb``.

    Held blocks are the computing one plus ``ahead``, each counted at the largest block's
    size; when every block fits, they all stay (keep_all). Activations are not counted."""
    budget = int(budget_gb * 2**30)
    total = fixed_bytes + sum(block_bytes)
    if total <= budget:
        return len(block_bytes) - 1, True
    largest = max(block_bytes)
    held = (budget - fixed_bytes) // largest
    if held < 2:
        need = (fixed_bytes + 2 * largest) / 2**30
        raise OffloadConfigError(
            "max_resident_gb", budget_gb,
            f"at least {need:.3f} GiB for this model (its weights outside the streamed blocks, "
            f"{fixed_bytes / 2**30:.3f} GiB, plus two blocks of {largest / 2**30:.3f} GiB)")
    return int(min(held, len(block_bytes)) - 1), False
