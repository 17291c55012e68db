"""Errors that name what the user got wrong; the CLI maps them to exit code 2, gRPC to INVALID_ARGUMENT."""


class InvalidArgument(ValueError):
    """A user-supplied value is not acceptable. `field` names the argument, key or path at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # pickled by its fields: it crosses processes (a Ray actor's error) intact
        return type(self), (self.field, self.message)


class ModelLoadError(InvalidArgument):
    """A checkpoint directory cannot be loaded (missing, incomplete or of an unsupported kind)."""
