"""The stock openpi client against omnidit's robot WebSocket (a server with `--model reach`, e.g. `make run`).

openpi-client is installed by `make install` (`pip install --no-deps openpi-client` elsewhere).
"""

import os

from openpi_client.websocket_client_policy import WebsocketClientPolicy

from dit_core.zoo.reach_env import ReachEnv

url = os.environ.get("OMNIDIT_URL", "http://127.0.0.1:8000").replace("http", "ws", 1)
policy = WebsocketClientPolicy(f"{url}/v1/realtime/robot/openpi?model=reach&deadline_ms=500",
                               api_key=os.environ.get("OMNIDIT_API_KEY"))  # sent as `Authorization: Api-Key KEY`
print(policy.get_server_metadata())  # observation keys, image size, state_dim, action_horizon, action_dim, session
policy.infer({"reset": True})  # start of an episode: clears this connection's session
obs, _ = ReachEnv().reset(seed=0)  # {"observation/image": uint8 [64, 64, 3], "observation/state": [4], "prompt": str}
reply = policy.infer(obs)
print(reply["actions"].shape)  # float32 [16, 2]: [action_horizon, action_dim]
print(reply["server_timing"])  # infer_ms, queue_ms, engine_ms, deadline_ms, deadline_met, steps, prev_total_ms
