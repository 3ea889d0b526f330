"""How `make test` splits the suite over two pytest-xdist workers (``-n 2 --dist loadgroup``).

A 2-core machine running the suite in one process keeps one core idle for about 40% of the time:
most of the idle stretches are subprocesses importing torch, diffusers, vLLM or Ray on one core. Two
workers fill them. Each worker is its own process with its own session fixtures, caches
(``OMNIDIT_CACHE_DIR`` and inductor's, made per process by conftest.py) and temporary folders.

Every module runs whole on one worker (its module fixtures start once). Modules that share a session
fixture, or that must not run beside each other, form one group and run on one worker, one after
another. ``WEIGHT`` is each heavy group's approximate share of the suite (seconds on the reference
2-core machine, for ordering only: nothing depends on its accuracy): the scheduler hands out the
heaviest groups first, so the two workers finish close together.

Run one module or one test as usual (``pytest tests/test_x.py``): without ``-n`` nothing here applies.
"""

from __future__ import annotations

import pytest

# group -> its modules (file stems). Why each group is one:
GROUPS = {
    # the compiled tiny FLUX (conftest.compiled_flux) and its inductor cache, compiled once
    "compile": ("test_compile", "test_warm_start"),
    # the shared live server (conftest.reliability_server)
    "reliability": ("test_api_keys", "test_body_limit", "test_faults", "test_memory", "test_reliability",
                    "test_request_timeout", "test_route_errors", "test_schema_bodies", "test_traffic_counts"),
    # the shared playground server and browser (tests/playground_fixtures.py)
    "playground": ("test_playground", "test_playground_edits", "test_playground_forms", "test_playground_robot"),
    # real vLLM engines: each binds its OpenMP threads to the cores, and one at a time is enough
    "vllm": ("test_thinker", "test_tts_vllm"),
    # local Ray clusters: one on the machine at a time
    "ray": ("test_ray_serve", "test_serve_flags_reach_replicas"),
    # gloo process pools (several processes each)
    "parallel": ("test_parallel", "test_parallel_launch"),
}
GROUP_OF = {module: group for group, modules in GROUPS.items() for module in modules}

# approximate seconds per group or module (summed test durations of a fresh-clone `make test` on a 2-core
# AVX2-only EPYC, 2026-12-03; ordering only; unknown: 0)
WEIGHT = {"ray": 281, "parallel": 270, "compile": 206, "vllm": 184, "playground": 136, "test_offload": 94,
          "test_lora": 78, "test_reuse_allocator": 70, "reliability": 60, "test_digits_edit": 50, "test_serve": 46,
          "test_bf16_fidelity": 39, "test_doc_examples": 37, "test_digits_lora": 34, "test_docs": 32,
          "test_step_cache": 26, "test_reach_policy": 24, "test_wan_two_stage": 21, "test_tts": 21, "test_quant": 20,
          "test_attention": 19, "test_cli_and_models": 19, "test_videos_api": 17, "test_wan_i2v": 16,
          "test_dtype_auto": 10}


def group_of(item: pytest.Item) -> str:
    module = item.path.stem
    return GROUP_OF.get(module, module)


def group_of_nodeid(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return GROUP_OF.get(module, module)


def order(items: list[pytest.Item]) -> None:
    """Order the tests heaviest group first (stable within a group). Every worker collects, and sorts
    the same way, so the workers' collections stay identical, as xdist requires."""
    items.sort(key=lambda item: -WEIGHT.get(group_of(item), 0))


def make_scheduler(config, log):
    """xdist's scope scheduler with a group as the scope: each group goes whole to one worker, in
    collection order (xdist's own ``loadgroup`` marks do not reach node ids under pytest 9)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of_nodeid(nodeid)

    return GroupScheduling(config, log)
