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


class LeaseLostError(FinetuneError):
    """Another run took over the lease on the key this run computes (this one stalled past the lease's TTL):
    this run stops and writes nothing more to the store."""


class NonFiniteOutputError(FinetuneError):
    """A model produced NaN or infinite outputs (corrupt or diverged weights)."""


class DiskFullError(FinetuneError):
    """A disk filled (or a file-size or quota limit was reached) while a stage wrote; nothing was committed."""


# How the libraries a stage writes through report a full disk: OSError's errno (ENOSPC, EDQUOT, EFBIG), and the
# messages of Arrow and safetensors (the OS's words, no errno) and sqlite.
_FULL_ERRNOS = {28, 122, 27}
_FULL_WORDS = ("no space left on device", "disk quota exceeded", "file too large", "database or disk is full")


def is_disk_full(e: BaseException) -> bool:
    """Whether an exception, or one it was raised from, says a disk (or a file-size limit) is full."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _FULL_ERRNOS:
            return True
        if any(w in str(cur).lower() for w in _FULL_WORDS):
            return True
        cur = cur.__cause__ or cur.__context__
    return False
