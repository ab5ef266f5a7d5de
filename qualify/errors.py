"""Error hierarchy: every input or usage problem a user can cause is a QualifyError.

The CLI turns a QualifyError into a one-line message and exit code 2; a failed
qualification is not an error but a verdict (exit code 1).
"""


class QualifyError(ValueError):
    """A problem with the user's input, files or environment (exit 2)."""


class MatrixError(QualifyError):
    """A matrix YAML file is malformed: unknown key, wrong type, missing field."""


class ManifestError(QualifyError):
    """A manifest cannot be trusted as input: bad schema, path escape, symlink."""


class EvidenceError(QualifyError):
    """Evidence on disk is missing, partial or does not match its digest."""


class OutputError(QualifyError):
    """An output file cannot be written: disk full, no permission, a directory where the file should go."""


class EngineError(QualifyError):
    """An engine is unknown, cannot be imported or refused the case."""


class FrozenError(QualifyError):
    """An attempt to rewrite or widen something that is frozen."""


class SlurmError(QualifyError):
    """Slurm refused a submission or a job of the chain failed to start."""


class RoundsError(QualifyError):
    """A rounds run could not go on: the live vLLM engine crashed or refused a request, an installed version's
    acknowledgments did not verify, or the trainer's step failed (probes expect some of these: they are caught)."""


class Refused(RoundsError):
    """The rollout engine refused a request in its current state: kind names the rule (stale_version,
    install_failed, unusable, warm_cache, ...), details what the engine said besides (acks, problems).
    Raised in the engine process, and again in the rounds stage from the engine's reply."""

    def __init__(self, kind: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.kind, self.details = kind, dict(details or {})
