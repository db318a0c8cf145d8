"""The exception family. Every message names the cause and the fix; the command line prints it as
one line and exits with code 2, never a traceback."""


class FinetuneError(Exception):
    """Base class: an error the user can fix."""

    exit_code = 2


class ConfigError(FinetuneError):
    """pipeline.yaml or a --set override is invalid."""


class MissingInputError(FinetuneError):
    """A data file, column, model or upstream artifact is not there."""


class DataError(FinetuneError):
    """The data is there but unusable (labels out of range, empty split...)."""


class HubUnreachableError(FinetuneError):
    """The Hugging Face hub cannot be reached and no local copy was configured."""


class DivergenceError(FinetuneError):
    """Training diverged (non-finite or exploding loss or gradients); nothing was committed."""


class CorruptArtifactError(FinetuneError):
    """A committed artifact's files no longer match its manifest (a flipped byte, a truncated file)."""


class NonFiniteOutputError(FinetuneError):
    """A model produced NaN or infinite outputs (corrupt or diverged weights)."""
