"""An environment for the multi-turn VLM rollout's tests (`rollout_interaction_env_path: tests._image_env`): it is
never done, and each observation is a new image (its size and colours set by the turn) and a line of text."""

import torch
from PIL import Image

from examples.geo3k_vlm_multi_turn.base_env import BaseInteractionEnv

SIZES = [(56, 28), (28, 84), (84, 56)]  # (width, height) of the image after turn 1, 2, 3


def image(turn):
    width, height = SIZES[(turn - 1) % len(SIZES)]
    g = torch.Generator().manual_seed(100 + turn)
    return Image.fromarray((torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8).numpy(), "RGB")


class ImageEnv(BaseInteractionEnv):
    def __init__(self):
        self.turn = 0
        self.seen = []

    def reset(self):
        self.turn = 0
        return {}, {}

    def step(self, response_text):
        self.turn += 1
        self.seen.append(response_text)
        return {"obs_str": "Look again.", "multi_modal_data": {"image": [image(self.turn)]}}, False, {}


def build_env(sample=None, args=None, **_):
    return ImageEnv()
