"""The synchronous engine: add requests, step, abort, generate."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import random
import secrets
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ar_adapters import PromptCache
from attention import resolve as resolve_attention

from .adapters.model_stores import adapter_store, attach_adapters, check_loras, pin_loras
from .cache import make_step_cache
from . import cpu_gelu, cpu_linear, invariant_linear
from .config import EngineConfig
from .errors import InvalidParamError, RequestAbortedError, failed_error
from .families import Family, load_family
from .keyword_checks import check_no_params_fields, check_option_names
from .loading import component_loader
from .offloading import after_loading, apply_offload, offload_loader, release_offload
from .params import SamplingParams, check_params
from .quantize import apply_quant
from .request import EventKind, Request, RequestEvent, RequestOutput, RequestStatus
from .faults import Faults
from .runner import Runner
from .scheduler import StepScheduler
from .step_times import StepTimes

logger = logging.getLogger(__name__)
DEFAULT_MODEL = "default"  # the name of a model handed to Engine() alone


class EngineStats:
    """Per-step history (bounded): how many requests and rows each forward carried."""

    def __init__(self, history: int = 100_000):
        self.steps = 0
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=history)
        self.batch_rows: collections.deque[int] = collections.deque(maxlen=history)
        self.step_ms: collections.deque[float] = collections.deque(maxlen=history)
        self.models: collections.deque[str | None] = collections.deque(maxlen=history)  # which model ran
        self.rows_skipped: collections.deque[int] = collections.deque(maxlen=history)  # by the step cache
        self.block_evals = 0  # rows x transformer blocks actually run
        self.block_evals_full = 0  # ... and what they would have been without a step cache
        # input images (image-to-image, inpainting) VAE-encoded when their requests were admitted, the VAE
        # calls that took (each at most the family's decode_pixel_budget pixels) and their seconds
        self.images_encoded = 0
        self.vae_encodes = 0
        self.vae_encode_s = 0.0

    def record_encode(self, images: int, calls: int, seconds: float) -> None:
        """The input images one step's admissions VAE-encoded (families call it: ``Family.on_encode``)."""
        self.images_encoded += images
        self.vae_encodes += calls
        self.vae_encode_s += seconds

    def record(self, requests: int, rows: int, step_ms: float, cache: dict | None = None,
               model: str | None = None) -> None:
        self.steps += 1
        self.models.append(model)
        self.batch_sizes.append(requests)
        self.batch_rows.append(rows)
        self.step_ms.append(step_ms)
        self.rows_skipped.append(cache["rows_skipped"] if cache else 0)
        if cache:
            self.block_evals += cache["block_evals"]
            self.block_evals_full += cache["block_evals_full"]


class Engine:
    """Step-level continuously batched diffusion engine.

    Each ``step()`` runs one batched forward over every scheduled request, each at its own
    timestep with its own sampler and seed; requests join and leave at step boundaries. One
    engine may hold several models under names: they share the step loop and the scheduler,
    their requests interleave at step boundaries but never share a forward. Not thread-safe:
    drive it from one thread (``AsyncEngine`` does so from its loop thread).
    """

    def __init__(self, models: Family | dict[str, Family], config: EngineConfig, defer_warmup: bool = False):
        if isinstance(models, Family):
            models = {DEFAULT_MODEL: models}
        if not models:
            raise InvalidParamError("models", models, "at least one model")
        self.config = config = dataclasses.replace(config)  # ours to adjust; the caller's stays as given
        if config.dtype == "auto":  # families loaded already: their dtype is the answer
            config.dtype = str(next(iter(models.values())).dtype).replace("torch.", "")
        self.models: dict[str, Family] = dict(models)
        self.prompt_cache = PromptCache(config.prompt_cache_bytes) if config.prompt_cache_bytes else None
        max_batch = {}
        self.attention_by_model = {}  # model -> its role -> backend map
        for family in self.models.values():
            family.check_config(config)  # settings the model cannot honour, refused before anything is set up
        for name, family in self.models.items():
            backends = resolve_attention(config.attention, config.device, config.torch_dtype, family.head_dims())
            self.attention_by_model[name] = backends
            family.set_attention(backends)
            family.prompt_cache = self.prompt_cache
            family.step_cache = None
            if config.cache.kind != "none":
                if family.supports_step_cache:
                    family.step_cache = make_step_cache(config.cache, family)
                else:
                    logger.info("model %s (%s) has no block loop: step cache %s not applied", name, family.name,
                                config.cache)
            if family.step_cache is not None and family.step_cache.request_level:
                logger.info("cache %s decides per forward: model %s runs one request per forward", config.cache, name)
                max_batch[name] = 1
        if len(max_batch) == len(self.models):
            config.max_batch_size = 1
        self.scheduler = StepScheduler(config, max_batch)
        self.batch_limits = None  # learned per-shape row limits (EngineConfig.batch_limits="learn")
        if config.batch_limits == "learn":
            from .batch_limits import BatchLimits

            self.batch_limits = BatchLimits(config.batch_gain_threshold, config.max_step_ms)
        self.scheduler.limits = self.batch_limits
        self.faults = Faults()  # fault-injection points, armed by tests only (dit_core/faults.py)
        for family in self.models.values():
            family.faults = self.faults
        attach_adapters(self.models, config)  # LoRA: before compiling, so compiled blocks hold the hooks
        self.runners = {name: Runner(family) for name, family in self.models.items()}
        self.parallel = None  # the parallel executor (dit_core.parallel) when a degree is > 1
        if config.parallel.enabled:
            from .parallel import launch

            self.parallel = launch(self.models, config.parallel, config.device, config.dtype, self.attention_by_model)
        from .mixed_sizes import enable

        enable(self.models, config)  # which models leave sizes out of their batch keys (after LoRA, parallel)
        self.stats = EngineStats()
        for family in self.models.values():
            family.on_encode = self.stats.record_encode
        self.step_times = StepTimes()
        self.scheduler.policy.step_times = self.step_times  # edf reads the estimates (slack, bulk batch cap)
        self._seq = itertools.count()
        # called inside a step, before a decode the policy may defer, to take in requests that arrived
        # during the step (AsyncEngine applies its queued commands); None: nothing arrives mid-step
        self.poll: Callable[[], None] | None = None
        self._pending: list[RequestEvent] = []
        self._live: dict[str, Request] = {}
        self.compile_info: dict = {}  # model -> dit_core.compile.CompileInfo (compiled or why not, warm-up)
        # model -> sizes still to warm up (dit_core.warmup), left by defer_warmup for the caller to run
        self.pending_warmup: dict = {}
        if config.compile or config.warmup is not None:
            from .compile import setup

            setup(self, defer=defer_warmup)

    @property
    def compile_warmup_s(self) -> float:
        """Seconds the start-up warm-up took (0 without one: ``warmup`` off, or ``compile`` off and no ``warmup``)."""
        return sum(info.warmup_s for info in self.compile_info.values())

    @classmethod
    def from_pretrained(cls, path: str | Path, name: str | None = None, **config) -> "Engine":
        """Load one model folder; ``name`` is its name in the engine (default: the folder's name).
        ``config`` fields: see ``EngineConfig``."""
        return cls.from_models({name or Path(path).resolve().name: path}, **config)

    @classmethod
    def from_models(cls, paths: dict[str, str | Path], **config) -> "Engine":
        """Load several model folders under names (``{"digits": path_a, "reach": path_b}``) into
        one engine: one step loop, one scheduler (``load_engine``, the one loading path)."""
        return load_engine(paths, config)

    @property
    def family(self) -> Family:
        """The default model's family (the first one loaded)."""
        return self.models[self.default_model]

    @property
    def attention(self) -> dict:
        """The default model's role -> attention backend map."""
        return self.attention_by_model[self.default_model]

    @property
    def default_model(self) -> str:
        return next(iter(self.models))

    def model_name(self, model: str | None) -> str:
        """Which model a request names; None means the only one."""
        if model is None:
            if len(self.models) == 1:
                return self.default_model
            raise InvalidParamError("model", model, f"one of {sorted(self.models)} (this engine holds several)")
        if model not in self.models:
            raise InvalidParamError("model", model, f"one of {sorted(self.models)}")
        return model

    # ---- requests ----

    def make_request(self, prompt, params: SamplingParams | None = None,
                     request_id: str | None = None, model: str | None = None) -> Request:
        """Validate and build a request without queueing it (pure; any thread may call it).
        ``prompt`` is the conditioning input: a prompt string, or what the model takes instead
        (an observation dict for a robot policy)."""
        name = self.model_name(model)
        family = self.models[name]
        params = family.resolve(SamplingParams() if params is None else check_params(params))
        if params.loras:
            check_loras(family, name, params.loras)
        text, inputs = family.validate_input(prompt, params)
        if self.parallel is not None:
            from .parallel import check_request

            check_request(name, family, params, self.config.parallel, self.parallel.health())
        if params.seed is None:
            params = params.with_defaults(seed=random.SystemRandom().randrange(2**63))
        cfg = family.uses_cfg(params)
        rows = params.num_outputs * (2 if cfg else 1)
        tokens = rows * family.row_tokens(text, params, inputs)
        if tokens > self.config.max_tokens_per_step:
            raise InvalidParamError(
                "height/width/num_outputs", f"{params.height}x{params.width} x {rows} rows = {tokens} tokens",
                f"at most max_tokens_per_step={self.config.max_tokens_per_step} tokens per request",
            )
        req = Request(
            id=request_id or secrets.token_hex(16), prompt=text, params=params, seq=next(self._seq),
            key=(name,) + family.batch_key(params), rows=rows, tokens=tokens, cfg=cfg, model=name,
            kind=family.output_kind, inputs=inputs,
        )
        req.metrics.deadline_ms = params.deadline_ms
        return req

    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, model: str | None = None) -> str:
        """Queue a request (or a ``Request`` from ``make_request``); it joins at the next step."""
        req = prompt if isinstance(prompt, Request) else self.make_request(prompt, params, request_id, model)
        if req.id in self._live:
            raise InvalidParamError("request_id", req.id, "an id not used by a live request")
        if req.params.loras:  # held until the request's final event: never evicted while it runs
            pin_loras(self.models[req.model], req.model, req.params.loras)
        self._live[req.id] = req
        self.scheduler.add(req)
        self._pending.append(RequestEvent(req.id, EventKind.QUEUED, 0, req.total_steps))
        return req.id

    def abort(self, request_id: str, reason: str = "aborted by client") -> bool:
        """Abort a live request at the next step boundary. False if it is unknown or done."""
        return self.scheduler.abort(request_id, reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_request(self, request_id: str) -> Request | None:
        return self._live.get(request_id)

    # ---- LoRA adapters (dit_core.adapters; EngineConfig.max_loras) ----

    def load_lora(self, name: str, path: str | Path, model: str | None = None, transformers=None) -> dict:
        """Make the LoRA file ``path`` resident for ``model`` as ``name`` (requests then name it in
        ``SamplingParams.loras``); returns its description. ``AdapterError`` on a bad file or name.
        ``transformers`` (two-stage Wan 2.2): ``"transformer"`` or ``"transformer_2"`` applies it to that
        one only (diffusers' ``load_lora_weights`` without / with ``load_into_transformer_2=True``); None,
        to both (``dit_core.adapters.store``).
        Unlike the rest of the engine, ``load_lora``, ``unload_lora`` and ``loras`` may be called from any
        thread while the engine steps (the adapter store changes its set under a lock; the file is read
        outside it): a server loads adapters in a worker thread while an ``AsyncEngine`` serves."""
        model = self.model_name(model)
        store = adapter_store(self.models[model], model, name)
        adapter = store.load(name, path, transformers)
        return next(d for d in store.describe() if d["name"] == adapter.name)

    def unload_lora(self, name: str, model: str | None = None) -> None:
        model = self.model_name(model)
        adapter_store(self.models[model], model, name).unload(name)

    def loras(self, model: str | None = None) -> list[dict]:
        """The resident adapters of ``model``: name, path, rank, layers, bytes, in_use (live requests)."""
        model = self.model_name(model)
        store = getattr(self.models[model], "adapters", None)
        return store.describe() if store is not None else []

    def _release(self, req: Request | None) -> None:
        if req is not None and req.params.loras:
            store = getattr(self.models[req.model], "adapters", None)
            if store is not None:
                store.unpin(req.params.loras)

    # ---- the loop ----

    def step(self) -> list[RequestEvent]:
        """One engine step; returns the events it produced (queued, step, finished, failed, aborted)."""
        events, self._pending = self._pending, []
        batch, aborted = self.scheduler.schedule()
        events += aborted
        if batch is not None:
            policy = self.scheduler.policy
            defer = self._defer_decode if policy.defers_decode else None
            out = self.runners[batch.model].run(batch, defer, policy.decode_chunk() if defer else 0)
            events += self.scheduler.postprocess(batch, out)
            self.stats.record(len(batch.requests), batch.rows, out.step_ms, out.cache, batch.model)
            self.step_times.observe(batch.key, len(batch.requests), out.step_ms)
            self.scheduler.learn(batch, out)
        for ev in events:
            if ev.kind.final:
                self._release(self._live.pop(ev.request_id, None))
        return events

    def _defer_decode(self, done: list[Request]) -> list[Request]:
        """Which requests the step just denoised decode later (the policy decides; see ``dit_core.policies``)."""
        policy = self.scheduler.policy
        if not policy.deferrable(done):  # nothing to defer: no need to look at what arrived
            return []
        if self.poll is not None:
            self.poll()
        return policy.defer_decode(done, self.scheduler.running + self.scheduler.waiting)

    def fail_unfinished(self, message: str) -> list[RequestEvent]:
        """Mark every live request FAILED (used when a step breaks outside any one request)."""
        events = []
        for req in list(self._live.values()):
            req.status, req.error = RequestStatus.FAILED, message
            events.append(RequestEvent(req.id, EventKind.FAILED, req.step_index, req.total_steps, error=message))
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        for req in self._live.values():
            self._release(req)
        self._live.clear()
        return events

    def health(self) -> str | None:
        """None while the engine can serve; else why not (a parallel worker that died, a model's AR stage
        whose engine process died and is being replaced)."""
        problems = [self.parallel.health()] if self.parallel is not None else []
        problems += [f"model {name!r}: {p}" for name, f in self.models.items() if (p := f.health()) is not None]
        return "; ".join(p for p in problems if p) or None

    def close(self) -> None:
        """Release what the models started (a vLLM thinker's engine process, parallel workers, an offload
        loader thread)."""
        if self.parallel is not None:
            self.parallel.close()
        for family in self.models.values():
            release_offload(family)
            family.close()

    # ---- convenience ----

    def generate(self, prompts: str | list[str], params: SamplingParams | None = None,
                 model: str | None = None, **misplaced) -> list:
        """Run ``prompts`` to completion and return their outputs (images for an image model), in
        prompt order (``num_outputs`` each). With a seed, prompt i uses ``seed + i``. Inputs such as
        ``image``, ``mask`` and ``strength`` are ``SamplingParams`` fields (given here: a TypeError saying so)."""
        check_no_params_fields("generate", misplaced)
        return [img for out in self.generate_outputs(prompts, params, model) for img in out.outputs]

    def generate_outputs(self, prompts: str | list[str], params: SamplingParams | None = None,
                         model: str | None = None, **misplaced) -> list[RequestOutput]:
        check_no_params_fields("generate_outputs", misplaced)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidParamError("prompts", prompts, "a prompt string or a non-empty list of strings")
        params = SamplingParams() if params is None else check_params(params)
        requests = [self.make_request(p, _seeded(params, i), model=model) for i, p in enumerate(prompts)]
        return self.run_to_completion(requests)

    def infer(self, observation: dict, params: SamplingParams | None = None, model: str | None = None) -> dict:
        """One action chunk for a robot policy model, run to completion (openpi's ``infer``):
        ``{"actions": float32 array [H, action_dim]}``. Other requests in flight keep stepping."""
        name = self.model_name(model)
        require_policy(self.models[name], name)
        return actions_result(self.run_to_completion([self.make_request(observation, params, model=name)])[0])

    def run_to_completion(self, requests: list[Request]) -> list[RequestOutput]:
        """Queue ``requests`` (from ``make_request``), step until all end; their outputs in order.
        Raises RequestFailedError / RequestAbortedError for the first that did not finish. While the
        policy holds steps back (edf, a forecast arrival), it sleeps until the hold ends: nothing can
        arrive here meanwhile."""
        for req in requests:
            self.add_request(req)
        finals: dict[str, RequestEvent] = {}
        while len(finals) < len(requests):
            steps = self.stats.steps
            for ev in self.step():
                if ev.kind.final:
                    finals[ev.request_id] = ev
            held = self.scheduler.policy.hold_until - time.perf_counter()
            if held > 0 and self.stats.steps == steps and len(finals) < len(requests):
                time.sleep(held)
        for req in requests:
            ev = finals[req.id]
            if ev.kind == EventKind.FAILED:
                raise failed_error(req.id, ev.error, ev.retry_after_s)  # (a stage that was down: 503)
            if ev.kind == EventKind.ABORTED:
                raise RequestAbortedError(req.id, ev.error)
        return [finals[r.id].output for r in requests]


def load_engine(paths: dict[str, str | Path], options: dict | None = None, thinkers: dict | None = None,
                defer_warmup: bool = False) -> Engine:
    """Model folders (name -> folder) and ``EngineConfig`` fields (``options``) -> a ready engine.

    The one loading path: ``Engine.from_pretrained`` / ``from_models``, the ``omnidit`` commands, the
    benchmarks and the Ray Serve replicas all build their engines here, so every setting means the
    same everywhere. In order: ``dtype="auto"`` resolved; the heap (``malloc_mmap_threshold``) and the
    CPU allocator (``cpu_allocator``) set up and the offload loader chosen (``offload_loader``); each
    model loaded, quantized (``quant``), its linears packed (``cpu_linear``) and its offload attached;
    then the engine. ``thinkers``: model name -> a ready ``ar_adapters.Thinker`` that model uses instead
    of the one ``thinker`` would build (a Ray replica's shared thinker stage). ``defer_warmup``: leave the
    start-up warm-up in ``Engine.pending_warmup`` (the HTTP server runs it while it listens)."""
    if not isinstance(paths, dict) or not paths:
        raise InvalidParamError("models", paths, "a non-empty {name: model folder} mapping")
    from .zoo import folder_of

    paths = {name: folder_of(path) for name, path in paths.items()}  # (an embedded model's name: its folder)
    options = dict(options or {})
    check_option_names(options)
    cfg = EngineConfig(**options)
    thinkers = dict(thinkers or {})
    unknown = set(thinkers) - set(paths)
    if unknown:
        raise InvalidParamError("thinkers", sorted(unknown), f"names among the models {sorted(paths)}")
    dtype_choice = None  # dtype="auto": what it chose and measured (config.dtype_auto in the stats)
    if cfg.dtype == "auto" and (cfg.offload.streams_blocks or cfg.max_resident_gb is not None):
        # measuring would load every block at once, which the memory budget exists to avoid
        logger.info("dtype auto -> float32: block offload is on, so the model is not loaded whole to measure")
        cfg.dtype = "float32"
        dtype_choice = {"dtype": "float32", "reason": "block offload is on: the model is not loaded whole to measure"}
    elif cfg.dtype == "auto":  # measured once per machine and model (dit_core.dtype_auto)
        from .dtype_auto import resolve

        choice = resolve(paths, options)
        cfg.dtype, dtype_choice = choice.dtype, choice.as_dict()
    if cfg.dtype == "bfloat16" and torch.device(cfg.device).type == "cpu" and not cfg.batch_invariant:
        from .cpu_gemm_rows import bf16_rows_invariant

        same, what = bf16_rows_invariant()
        if not same:
            logger.warning("bfloat16 on this CPU: a request's output may differ with what it is batched with, "
                           "by bf16 rounding (%s); float32, or batch_invariant=True, keeps it the same", what)
    stage_options = dict(kv_cache_gb=cfg.thinker_kv_cache_gb, memory_utilization=cfg.thinker_memory_utilization,
                         on_failure=cfg.thinker_on_failure)
    models = {}
    try:
        for name, path in paths.items():
            if not isinstance(name, str) or not name.strip():
                raise InvalidParamError("models", name, "a non-empty model name")
            with component_loader(offload_loader(cfg)):  # offload: leave streamed blocks unread
                models[name] = load_family(path, cfg.torch_dtype, torch.device(cfg.device),
                                           thinkers.get(name, cfg.thinker), stage_options)
            models[name].check_config(cfg)  # before quantizing or offloading it (Engine asks again)
            apply_quant(models[name], cfg.quant)  # EngineConfig.quant: swap Linear layers (quant/)
            invariant_linear.apply(models[name], cfg, name)  # EngineConfig.batch_invariant: CUDA GEMMs
            cpu_linear.apply(models[name], cfg, name)  # EngineConfig.cpu_linear: oneDNN-packed linears
            cpu_gelu.apply(models[name], cfg, name)  # float32 on CPU: the tanh-GELUs left apart on omnidit's kernel
            apply_offload(models[name], cfg)  # after loading, before the engine sees the family
            after_loading()  # the reuse allocator forgets what loading freed
        engine = Engine(models, cfg, defer_warmup)
        engine.dtype_choice = dtype_choice
        return engine
    except BaseException:
        for family in models.values():
            release_offload(family)
            family.close()
        raise


def require_policy(family: Family, name: str) -> None:
    if family.output_kind != "actions":
        raise InvalidParamError("model", name, f"a policy model (output kind 'actions'); {name} makes {family.output_kind}")


def actions_result(output: RequestOutput) -> dict:
    """A policy request's output as openpi returns it: ``{"actions": float32 [H, action_dim]}``."""
    return {"actions": np.asarray(output.actions, dtype=np.float32)}


def _seeded(params: SamplingParams, index: int) -> SamplingParams:
    if params.seed is None or index == 0:
        return params
    from dataclasses import replace

    return replace(params, seed=(params.seed + index) % 2**63)
