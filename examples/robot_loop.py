"""A closed robot control loop over omnidit's OpenPI WebSocket, with the stock openpi client.

Start a server with the reaching policy (and, if you like, the image model beside it):

    omnidit serve --model digits --model reach --api-key KEY

then drive the simulated reaching task (dit_core/zoo/reach_env.py) at a fixed control rate:

    python examples/robot_loop.py --url ws://127.0.0.1:8000/v1/realtime/robot/openpi --api-key KEY \\
        --model reach --episodes 10 --rate 10 --deadline-ms 500 [--rtc-delay 2]

Each cycle sends one observation (camera, state, instruction) with ``WebsocketClientPolicy.infer``
and executes the returned chunk's actions at ``--rate`` Hz up to ``--exec-horizon``; episodes
start with a reset frame. It prints the success rate and the chunk latency percentiles the robot saw.
"""

from __future__ import annotations

import argparse
import json
from urllib.parse import urlencode

import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from dit_core.eval.remote_policy import run_remote


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime/robot/openpi", help="the robot socket URL")
    p.add_argument("--api-key", default=None, help="the server's API key (sent as 'Authorization: Api-Key KEY')")
    p.add_argument("--model", default=None, help="the policy's model id (default: the server's only policy)")
    p.add_argument("--episodes", type=int, default=10, help="episodes, seeds 0..N-1 (default 10)")
    p.add_argument("--rate", type=float, default=10.0, help="control rate in Hz; 0: as fast as possible (default 10)")
    p.add_argument("--deadline-ms", type=float, default=None,
                   help="each chunk's latency budget (default: the server's --robot-deadline-ms)")
    p.add_argument("--exec-horizon", type=int, default=8, help="actions executed per chunk (default 8)")
    p.add_argument("--rtc-delay", type=int, default=0,
                   help="real-time chunking: control steps the robot keeps executing the old chunk while the new "
                        "one is computed (default 0: off)")
    args = p.parse_args(argv)

    query = {k: v for k, v in (("model", args.model), ("deadline_ms", args.deadline_ms)) if v is not None}
    if args.rtc_delay:
        query.update(rtc_delay=args.rtc_delay, exec_horizon=args.exec_horizon)
    url = args.url + (("&" if "?" in args.url else "?") + urlencode(query) if query else "")
    policy = WebsocketClientPolicy(url, api_key=args.api_key)
    meta = policy.get_server_metadata()
    print(f"connected to {meta['model']}: chunks of {meta['action_horizon']} x {meta['action_dim']}, "
          f"session {json.dumps(meta['session'])}")
    loop = run_remote(policy, list(range(args.episodes)), delay=args.rtc_delay, exec_horizon=args.exec_horizon,
                      rate_hz=args.rate or None)
    successes = [e.success for e in loop.episodes]
    met = [t.get("deadline_met") for t in loop.server_timing if t.get("deadline_met") is not None]
    print(f"success {np.mean(successes):.0%} ({sum(successes)}/{len(successes)}), "
          f"mean steps {np.mean([e.steps for e in loop.episodes]):.1f}")
    print(f"chunk latency ms: p50 {loop.percentile(50):.1f}, p95 {loop.percentile(95):.1f}, "
          f"p99 {loop.percentile(99):.1f} over {len(loop.latencies_ms)} chunks"
          + (f"; deadline met {np.mean(met):.1%}" if met else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
