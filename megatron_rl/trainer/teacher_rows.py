"""Which teacher scores which sample: a record's ``data_source`` names its teacher, ``default``
takes the rest.  Every prompt of the set is matched once, at start-up, so a prompt no teacher
would score is refused before the first step rather than trained on without distillation."""

from __future__ import annotations

from megatron_rl.data.prompts import PromptSet
from megatron_rl.engine.teachers import DEFAULT_SOURCE, KEY, teacher_of
from megatron_rl.errors import ConfigError


class TeacherRows:
    def __init__(self, teachers: tuple, prompts: PromptSet):
        self.names = tuple(t.name for t in teachers)
        self._of_prompt: list[str] = []
        if not teachers:
            return
        for i, fields in enumerate(prompts.record_fields(range(len(prompts)))):
            source = fields.get("data_source")
            teacher = teacher_of(teachers, source)
            if teacher is None:
                raise ConfigError(KEY, sorted(self.names), f"prompt {prompts.source_index[i]} of "
                                  f"{prompts.path or 'the data'} has data_source={source!r}, which no teacher scores",
                                  f"add a teacher for {source!r}, or a `{DEFAULT_SOURCE}` one for every other source")
            self._of_prompt.append(teacher.name)

    def of(self, samples) -> dict[str, list[int]]:
        """``{teacher name: rows of samples}`` (every teacher, an empty list when it scores none of
        them); {} without distillation."""
        if not self.names:
            return {}
        rows: dict[str, list[int]] = {name: [] for name in self.names}
        for row, index in enumerate(samples.dataset_index):
            rows[self._of_prompt[index]].append(row)
        return rows
