"""The errors users see for bad input (config, data, checkpoint, reward output).

Every layer raises these; the CLI prints ``str(err)`` on one line (``ConfigErrors``: one line per
refused setting) and exits 2.  ``key`` is a real
config key (``data.train_path``) or a file location (``prompts.jsonl:12``, ``CKPT/meta.json``).
"""

from __future__ import annotations

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # the shell's code for a job ended by SIGINT (a second Ctrl-C)


class UserInputError(Exception):
    """Bad config, data or checkpoint.  The CLI prints ``str(err)`` on one line and exits 2."""

    def __init__(self, key: str, value, problem: str, fix: str, row: str | None = None):
        self.key, self.value, self.problem, self.fix, self.row = key, value, problem, fix, row
        super().__init__(self.one_line())

    def one_line(self) -> str:
        value = "" if self.value is None else f"={self.value}"
        row = f" [feature matrix: {self.row}]" if self.row else ""
        text = f"{self.key}{value}: {self.problem}; fix: {self.fix}{row}"
        return " ".join(text.split())


class ConfigError(UserInputError):
    def one_line(self) -> str:
        return "config error: " + super().one_line()


class ConfigErrors(ConfigError):
    """Every refused setting of a run at once, one line each with its fix: one run reports them all."""

    def __init__(self, key: str, value, problem: str, fix: str, row: str | None = None, errors=()):
        self.errors = list(errors)
        super().__init__(key, value, problem, fix, row)

    @classmethod
    def of(cls, errors: list[UserInputError]) -> "ConfigErrors":
        return cls("config", None, f"{len(errors)} settings refused", "see each line", errors=errors)

    def one_line(self) -> str:
        """The head line, then one line per refused setting (the CLI prints ``str(err)``)."""
        if not self.errors:
            return super().one_line()
        lines = [UserInputError.one_line(err) for err in self.errors]
        return "\n".join([f"config error: {len(lines)} settings refused, each with its fix:"] +
                         [f"  {line}" for line in lines])


class DataError(UserInputError):
    def one_line(self) -> str:
        return "data error: " + super().one_line()


class CheckpointError(UserInputError):
    def one_line(self) -> str:
        return "checkpoint error: " + super().one_line()


class StorageError(UserInputError):
    """The disk cannot hold what the run writes (a checkpoint, the run's config)."""

    def one_line(self) -> str:
        return "storage error: " + super().one_line()
