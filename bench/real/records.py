"""One prompt/completion pair as a slicer reads it from its source (the type the slicing steps share)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceRecord:
    """One prompt/completion pair as read from a source, with its group and origin."""

    prompt: str
    completion: str
    family: str
    dataset: str
    template: str
    extra: tuple[tuple[str, str], ...] = ()  # further fields written after the standard ones
    example_id: str = ""  # "<dataset>:<n>", set by build_slice (example_group_ids)

    def to_alpaca(self) -> dict[str, str]:
        """The shipped record: Alpaca fields, then family, dataset, template, example_id and any extra fields."""
        record = {
            "instruction": self.prompt,
            "input": "",
            "output": self.completion,
            "family": self.family,
            "dataset": self.dataset,
            "template": self.template,
            "example_id": self.example_id,
        }
        record.update(dict(self.extra))
        return record
