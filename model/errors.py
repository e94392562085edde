"""Errors raised by the model package.

Each one says what was wrong and where (file, tensor, shapes), so a user can fix their
checkpoint or request without reading our code.
"""


class ModelError(Exception):
    """Base class for every error the model package raises on purpose."""


class ModelLoadError(ModelError):
    """A checkpoint could not be read: missing/corrupt file, missing tensor, bad shape."""


class UnsupportedModelError(ModelError):
    """The checkpoint is readable but describes an architecture or feature raylm lacks."""


class PromptTooLongError(ModelError, ValueError):
    """The prompt (plus requested new tokens) does not fit the model's context window."""


class LoraAdapterError(ModelError, ValueError):
    """A LoRA adapter cannot be served: unreadable or malformed files, a feature raylm lacks
    (DoRA, ``modules_to_save``, biases), or shapes and ranks its base model or replica refuse."""
