"""Every ``omnidit serve`` flag means the same with ``--replicas`` (Ray Serve) as without.

The test walks the CLI's own parser: each flag must be declared in ``serve.ray_flags.REACH`` (how it
reaches the engine replicas), and each declaration is checked by running ``omnidit serve`` twice with
the flag set to a non-default value, once in one process and once with ``--replicas 1``, up to the
point where the server would start (``serve.server.serve`` and ``serve.ray_app.launch.serve_on_ray``
are replaced by recorders): an engine flag must land in the same ``EngineConfig`` field in the
in-process engine's options and in the replicas' ``ScaleOutConfig.engine`` (which every replica hands
to the same ``load_engine``), a server flag in the same ``ServeSettings`` field in both, a Ray flag in
its ``ScaleOutConfig`` field, and a flag that only starts the command must change nothing the replicas
get. That replicas and the in-process server then build the same engine from those options is checked
on a live Ray cluster (tests/test_ray_serve.py, the effective ``config`` of ``/v1/engine/stats``).
"""

import argparse
import dataclasses
import json

import pytest

import serve.server
from dit_core import EngineConfig
from serve import ray_flags
from serve.app import ServeSettings
from dit_core.zoo import default_policy
from serve.cli import build_parser

# example values for flags whose value the test cannot make up from the parser (free-form strings)
EXAMPLES = {
    "model": str(default_policy()), "models": "tts", "replicas": "2", "host": "0.0.0.0", "ray_address": "auto",
    "api_key": "k3y", "model_name": "named", "video_dir": "{tmp}/videos", "api_keys_file": "{tmp}/keys.txt",
    "dtype": "bfloat16", "compile_warmup": "32x32", "warmup": "32x32", "device": "cpu:0", "attention": "math",
    "cache": "teacache:0.2", "thinker": "hf", "offload": "components", "quant": "int8-dynamic",
    # policy: not the default, which is edf for a bare `omnidit serve` (it serves the reach policy too)
    "attention_per_role": "joint=math", "malloc_mmap_threshold": "2097152", "policy": "fifo",
    "autoscaling": json.dumps({"upscale_delay_s": 5}), "cpu_linear": "aten",
    "lora_dir": "{tmp}", "lora_admins": "alice,bob", "lora": "style={tmp}/style.safetensors",
}


def serve_actions() -> list[argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices["serve"]._actions if not isinstance(a, argparse._HelpAction)]


def example_argv(action: argparse.Action, tmp) -> list[str]:
    """The flag with a value other than its default, as a user would type it."""
    name = action.option_strings[-1] if action.option_strings else None
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return [name]
    if action.dest in EXAMPLES:
        value = EXAMPLES[action.dest].replace("{tmp}", str(tmp))
    elif action.choices:
        value = next(c for c in action.choices if c != action.default)
    elif action.nargs == "*":
        return [name]  # the flag alone (e.g. --shared-thinker: every model that has a thinker)
    elif action.type in (int, float):
        value = str(action.type(action.default * 2 if action.default else 1))
    else:
        pytest.fail(f"omnidit serve {name or action.dest}: no example value; add one to EXAMPLES in {__file__}")
    return [name, value] if name else [value]


class Recorded(Exception):
    """Raised by the recorders: the command got as far as starting the server."""


@pytest.fixture
def run(monkeypatch, tmp_path):
    """argv -> what ``omnidit serve`` would start: ("process", models, settings, options, shutdown_timeout_s)
    or ("ray", ScaleOutConfig, host, port, ray_address, verbose)."""
    import serve.ray_app.launch

    (tmp_path / "keys.txt").write_text("another-key alice\n")
    calls = []

    def in_process(models, host, port, settings, shutdown_timeout_s, **options):
        calls.append(("process", models, settings, options, shutdown_timeout_s, host, port))
        raise Recorded

    def on_ray(cfg, host, port, ray_address, verbose):
        calls.append(("ray", cfg, host, port, ray_address, verbose))
        raise Recorded

    monkeypatch.setattr(serve.server, "serve", in_process)
    monkeypatch.setattr(serve.ray_app.launch, "serve_on_ray", on_ray)

    def call(argv: list[str]):
        args = build_parser().parse_args(["serve", *argv])
        with pytest.raises(Recorded):
            args.func(args)  # cmd_serve, as `omnidit serve ...` runs it
        return calls.pop()

    return call


def test_every_serve_flag_declares_how_it_reaches_the_replicas():
    dests = {a.dest: a.option_strings[-1] if a.option_strings else a.dest for a in serve_actions()}
    missing = sorted(flag for dest, flag in dests.items() if dest not in ray_flags.REACH)
    assert not missing, (
        f"omnidit serve flags {missing} do not say how they reach the engine replicas under --replicas: add each "
        "to serve.ray_flags.REACH, keyed by argparse dest, as Reach('engine', EngineConfig field), Reach('settings', "
        "ServeSettings field), Reach('scale_out', ScaleOutConfig field), Reach('models') or Reach('launch', "
        "reason=why the replicas need not see it)")
    stale = sorted(set(ray_flags.REACH) - set(dests))
    assert not stale, f"serve.ray_flags.REACH declares flags omnidit serve no longer has: {stale}"
    for dest, reach in ray_flags.REACH.items():
        assert reach.kind in ray_flags.KINDS, (dest, reach)
        assert (reach.kind == "launch") == bool(reach.reason), (dest, "a launch-only flag says why, and only it")


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("action", serve_actions(), ids=lambda a: a.option_strings[-1] if a.option_strings
                         else a.dest)
def test_the_flag_reaches_the_replicas_with_the_same_meaning(action, run, tmp_path):
    reach = ray_flags.REACH.get(action.dest)
    assert reach is not None, f"{action.dest}: not declared in serve.ray_flags.REACH (see the test above)"
    flag = example_argv(action, tmp_path)
    ray_default, ray_set = run(["--replicas", "1"]), run(["--replicas", "1", *flag])
    cfg0, cfg = ray_default[1], ray_set[1]
    if reach.kind in ("engine", "settings", "models"):  # the same flag without Ray: one engine in this process
        local0, local = run([]), run(flag)
    if reach.kind == "engine":
        assert reach.field in _fields(EngineConfig), reach
        value = local[3][reach.field]
        assert value != local0[3].get(reach.field), f"{flag} changes nothing in the in-process engine's options"
        assert cfg.engine[reach.field] == value, f"{flag}: the replicas get {cfg.engine[reach.field]!r}, " \
                                                 f"the in-process engine {value!r}"
        assert EngineConfig(**cfg.engine) is not None  # (every replica builds its engine from exactly this)
    elif reach.kind == "settings":
        assert reach.field in _fields(ServeSettings), reach
        value = getattr(local[2], reach.field)
        assert value != getattr(local0[2], reach.field), f"{flag} changes no server setting"
        assert cfg.settings[reach.field] == value, f"{flag}: the Ray app gets {cfg.settings[reach.field]!r}, " \
                                                   f"the in-process server {value!r}"
        assert cfg.settings == dataclasses.asdict(local[2])  # the ingress and the replicas: the same settings
    elif reach.kind == "models":
        assert local[1] != local0[1] and cfg.models == local[1], (flag, cfg.models, local[1])
    elif reach.kind == "scale_out":
        from serve.ray_app import ScaleOutConfig

        assert reach.field in _fields(ScaleOutConfig), reach
        assert getattr(cfg, reach.field) != getattr(cfg0, reach.field), f"{flag} changes nothing on Ray"
        assert {k: v for k, v in cfg.to_dict().items() if k != reach.field} == \
            {k: v for k, v in cfg0.to_dict().items() if k != reach.field}, f"{flag} sets more than {reach.field}"
    else:  # launch: how the command starts; nothing the replicas get changes
        assert reach.kind == "launch" and reach.reason
        assert cfg.to_dict() == cfg0.to_dict(), f"{flag} is declared launch-only but changes the replicas' config"
        assert ray_set[2:] != ray_default[2:], f"{flag} changes nothing at all"
