"""The package's errors: one base class, one subclass per kind of failure, and the one error of
a token id out of range (id_out_of_range, negative_id).

Each also derives from the builtin a caller would expect (a bad file is a ValueError, a
store that fails a RuntimeError), so `except ValueError` keeps working.
"""


class EngramStreamError(Exception):
    """Base of every error engram_stream raises on purpose."""


class CheckpointError(EngramStreamError, ValueError):
    """A file that is not a valid engram_stream checkpoint (truncated, corrupted, hostile)."""


class HFCheckpointError(CheckpointError):
    """A folder that is not a readable deepseek-v4.1 checkpoint (Hugging Face layout)."""


class FileChangedError(EngramStreamError, RuntimeError):
    """A mapped file was truncated or rewritten in place after it was mapped."""


class RowChecksumError(FileChangedError):
    """A record of the packed row file whose bytes do not match the checksum stored beside it
    (the file changed after it was packed, or the disk damaged it): nothing of that read is
    served. Names the file, the layer and the row."""


class IsaEnvironmentError(EngramStreamError, RuntimeError):
    """ENGRAM_STREAM_ISA names a kernel path this CPU (or build) does not run: `import
    engram_stream` refuses it (engine/isa.py), and the engram-stream command prints it as its
    one-line usage error (_engram_stream_launcher.py)."""


class TierError(EngramStreamError, RuntimeError):
    """A row source failed (store unreachable, short read, timeout, closed): nothing it
    returned was used and the engine is as it was before the call."""


class LayerError(EngramStreamError, KeyError):
    """A layer id that is not one of the model's Engram layers (a KeyError, as a dict lookup
    gives). Prints as its message, not as KeyError's quoted repr."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class ConfigFieldError(EngramStreamError, AttributeError, ValueError):
    """A config field read on a config of a variant that does not have it (each variant's own
    fields live in its config class): an AttributeError, so hasattr() says False, and a
    ValueError naming the field and the variants that use it."""


def id_out_of_range(token_id, vocab_size, negative_ids=True) -> ValueError:
    """The error of a token id at or past vocab_size, the one message of every check of it (the
    hash, the oracle, the engines). Where negative ids are valid input (Variant.negative_ids,
    DESIGN.md 14) it says so; else it gives the range [0, vocab_size)."""
    if not negative_ids:
        return ValueError(f"token id {token_id} out of range: ids must be in [0, vocab_size={vocab_size})")
    return ValueError(f"token id {token_id} out of range: ids must be < vocab_size={vocab_size} (negative ids are "
                      f"taken too: they have no compression entry, DESIGN.md 14)")


def negative_id(token_id, vocab_size, variant) -> ValueError:
    """The error of a negative token id given to a variant that takes none (Variant.negative_ids
    False, e.g. ids that index a token embedding): the one message of the hash and the engines."""
    return ValueError(f"token id {token_id} is negative: {variant} takes ids in [0, vocab_size={vocab_size}) "
                      f"only (its Variant.negative_ids is False)")


class ConfigKeyWarning(UserWarning):
    """A key of a config the user wrote that no variant reads but that looks like an Engram key
    (a misspelling: its value is ignored and the key it resembles takes its default). The
    message names the key and the closest key read."""


def shown(value, limit=200) -> str:
    """repr(value) as an error message shows it: cut past `limit` characters, saying how long
    it was (a megabyte of bad input stays a line), and a value too nested to repr said so."""
    try:
        r = repr(value)
    except RecursionError:
        return "an object nested too deeply to show"
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} characters)"
