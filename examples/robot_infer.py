"""A robot policy in this process: one observation in, one action chunk out (openpi's policy.infer)."""

from dit_core import Engine
from dit_core.zoo import default_policy
from dit_core.zoo.reach_env import ReachEnv

engine = Engine.from_pretrained(default_policy())  # the embedded reaching policy (0.5 M parameters)
obs, _ = ReachEnv().reset(seed=0)  # {"observation/image": uint8 [64, 64, 3], "observation/state": [4], "prompt"}
chunk = engine.infer(obs)["actions"]  # float32 [16, 2]: 16 velocity commands
print(obs["prompt"], chunk.shape)
print(engine.family.metadata)  # the keys, sizes and chunk shape the policy reads and returns
