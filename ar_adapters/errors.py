"""Errors of the AR stages (leaf package: no engine imports)."""


class PromptError(ValueError):
    """A prompt the stage cannot take (empty, or longer than the model allows)."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index
