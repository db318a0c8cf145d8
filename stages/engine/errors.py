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


class StoreUnavailableError(FinetuneError):
    """The store cannot be written (a read-only folder, a missing bucket, no rights) or does not answer."""


class DiskFullError(FinetuneError):
    """A disk filled (or a file-size or quota limit was reached) while a stage wrote; nothing was committed."""


# How the libraries a stage writes through report a full disk: OSError's errno (ENOSPC, EDQUOT, EFBIG), and the
# messages of Arrow and safetensors (the OS's words, no errno) and sqlite.
_FULL_ERRNOS = {28, 122, 27}
_FULL_WORDS = ("no space left on device", "disk quota exceeded", "file too large", "database or disk is full")


def _chain(e: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and all(cur is not s for s in seen):
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def is_disk_full(e: BaseException) -> bool:
    """Whether an exception, or one it was raised from, says a disk (or a file-size limit) is full."""
    return any((isinstance(c, OSError) and c.errno in _FULL_ERRNOS) or any(w in str(c).lower() for w in _FULL_WORDS)
               for c in _chain(e))


# How an fsspec store (s3fs through botocore and aiohttp) says its endpoint does not answer: a refused or
# timed-out connection, by class name, so that the engine imports none of those libraries.
_UNREACHABLE_CLASSES = ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError",
                        "ReadTimeoutError", "ClientConnectorError", "ServerDisconnectedError")


def is_unreachable(e: BaseException) -> bool:
    """Whether an exception, or one it was raised from, says a store's endpoint did not answer."""
    return any(isinstance(c, ConnectionError) or type(c).__name__ in _UNREACHABLE_CLASSES for c in _chain(e))


def store_failure(e: BaseException) -> str:
    """What a store's write or read failed on, in words (a missing bucket, no rights, no answer)."""
    for c in _chain(e):
        if isinstance(c, FileNotFoundError) and "bucket" in str(c).lower():
            return "its bucket does not exist"
        if isinstance(c, PermissionError):
            return f"permission denied ({str(c)[:120]})"
    if is_unreachable(e):
        return f"its endpoint does not answer ({type(e).__name__}: {str(e)[:160]})"
    return f"{type(e).__name__}: {str(e)[:160]}"
