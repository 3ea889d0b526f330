"""The pi0-shaped action policy: network, observation preprocessing, flow sampling, real-time
chunking and the checkpoint format. ``dit_core.families.pi0`` serves it on the engine's loop."""

from .checkpoint import load_policy, save_policy
from .config import CLASS_NAME, PolicyConfig
from .model import Pi0Model
from .observation import PREV_ACTIONS_KEY, PolicyInputs, read_observation
from .tokenizer import word_tokenizer

__all__ = ["CLASS_NAME", "PREV_ACTIONS_KEY", "Pi0Model", "PolicyConfig", "PolicyInputs", "load_policy",
           "read_observation", "save_policy", "word_tokenizer"]
