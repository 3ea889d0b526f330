"""AR stages as conditioning encoders: thinkers (prompt -> per-token hidden states) and talkers
(text -> discrete token ids), on vLLM or on transformers, plus a prompt-embedding cache.

A leaf package: it never imports the engine. ``make_thinker`` picks the implementation.
"""

from .cache import PromptCache
from .contract import Encoded, TalkerEvent, Thinker
from .errors import PromptError
from .hf import HFThinker
from .hf_talker import HFTalker
from .select import THINKERS, choose_thinker, make_talker, make_thinker, vllm_available
from .supervised import ON_FAILURE, StageDownError, SupervisedTalker, SupervisedThinker

__all__ = ["ON_FAILURE", "THINKERS", "Encoded", "HFTalker", "HFThinker", "PromptCache", "PromptError", "StageDownError",
           "SupervisedTalker", "SupervisedThinker", "TalkerEvent", "Thinker", "choose_thinker", "make_talker",
           "make_thinker", "vllm_available"]
