class BaseInteractionEnv:
    """What the multi-turn rollout (`rollout.generate`) asks of an environment; a module offering one has a
    `build_env(sample=..., args=...)` that returns it.

    - `reset()`: start an episode (the question is in the sample's prompt); returns (observation, info).
    - `step(response_text)`: take the model's turn; returns (observation, done, info).
    - `format_observation(observation)`: the chat message that carries the observation to the model.
    - `close()`: release what the episode held.
    """

    def reset(self):
        raise NotImplementedError

    def step(self, response_text: str):
        raise NotImplementedError

    def close(self):
        pass

    def format_observation(self, observation: dict) -> dict:
        """A user message: the observation's images (`multi_modal_data`: {kind: [image, ...]}, each a PIL image, a
        path, a URL or base64) first, then its text (`obs_str`)."""
        observation = observation or {}
        content = [
            {"type": "image", "image": image}
            for images in (observation.get("multi_modal_data") or {}).values()
            for image in images
        ]
        content.append({"type": "text", "text": observation.get("obs_str", "")})
        return {"role": "user", "content": content}
