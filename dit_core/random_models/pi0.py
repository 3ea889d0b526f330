"""A random-weight pi0-shaped policy (two cameras, state 5, actions 3 x 8) for tests.

Not tied to the reaching task: different sizes everywhere, so nothing task-specific hides in
the family code. The tokenizer knows a few words; others become [UNK]."""

from __future__ import annotations

from pathlib import Path

from ..policy import Pi0Model, PolicyConfig, save_policy, word_tokenizer

WORDS = "pick up place put the a red green blue cube block cup bowl into on left right please now".split()
SIZES = {
    "tiny": dict(image_size=16, width=32, layers=2, heads=2, head_dim=16, expert_width=24, vision_channels=(8, 16)),
    "small": dict(image_size=32, width=96, layers=3, heads=4, head_dim=24, expert_width=64, vision_channels=(24, 48)),
}


class RandomPolicy:
    """What ``random_models.build`` saves: a random policy and its tokenizer."""

    def __init__(self, size: str):
        cfg = PolicyConfig(image_keys=["observation/image", "observation/wrist_image"], state_dim=5, action_dim=3,
                           action_horizon=8, max_prompt_tokens=12,
                           norm_stats={"state": {"mean": [0.1] * 5, "std": [2.0] * 5},
                                       "actions": {"mean": [0.0, 0.5, -0.5], "std": [1.0, 2.0, 0.5]}},
                           **SIZES[size])
        self.tokenizer = word_tokenizer(WORDS)
        self.model = Pi0Model(cfg, self.tokenizer.get_vocab_size())

    def save_pretrained(self, out: str | Path) -> None:
        save_policy(out, self.model, self.tokenizer, {"num_inference_steps": 10})


def make_pipeline(size: str) -> RandomPolicy:
    return RandomPolicy(size)
