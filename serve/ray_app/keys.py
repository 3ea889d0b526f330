"""Routing keys: what the ingress knows of a request's batch key before any replica sees it.

A replica batches requests whose batch key matches (model, height, width, frames, dtype; see
``Family.batch_key``). The ingress cannot resolve a request's defaults without the model, so each
replica tells it every model's default size once (``route_defaults``) and the ingress fills them in.
Models without a size (text-to-audio, TTS, robot policies) batch every request of the model together
(their batch key is the model and its fixed latent length), so their key, ``"MODEL|-x-x1"``, is right
for them too; a video's key carries its frames. Replicas report their live requests under the same
keys. No Ray import here.
"""

from __future__ import annotations

from dit_core import SamplingParams


def route_key(model: str, params: SamplingParams | None, defaults: dict | None = None) -> str:
    """``"MODEL|HEIGHTxWIDTHxFRAMES"``, with the model's defaults for what ``params`` leaves unset."""
    defaults = defaults or {}
    params = params or SamplingParams()

    def pick(name: str, fallback):
        value = getattr(params, name)
        return value if value is not None else defaults.get(name, fallback)

    return f"{model}|{pick('height', '-')}x{pick('width', '-')}x{pick('num_frames', 1) or 1}"


def route_defaults(family) -> dict:
    """The default height / width / frames of ``family`` (a request that sets none of them)."""
    try:
        resolved = family.resolve(SamplingParams())
    except Exception:  # noqa: BLE001 - a family that needs more than defaults (e.g. a policy) keys by model
        return {}
    return {name: getattr(resolved, name) for name in ("height", "width", "num_frames")
            if getattr(resolved, name, None) is not None}
