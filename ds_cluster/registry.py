"""Named rules of one kind (feature kinds, budgets, selections, weightings, allocations): one registry each.

A rule is an object with a `name` (what the `cluster_sampling` block, the
command line and the docs call it) and the behaviour and properties the
stages ask of it. A registry is the one place a name is read: the config
validates against it, command-line choices and the docs list it, and the
stages look a rule up once and then ask the object, never its name.
"""
from __future__ import annotations

from typing import Callable, Generic, Iterable, Iterator, Mapping, Optional, TypeVar, Union

Rule = TypeVar("Rule")


class Registry(Mapping[str, Rule], Generic[Rule]):
    """The rules of one kind by name, in the order they were given (the order errors and docs list them)."""

    def __init__(self, setting: str, rules: Iterable[Rule],
                 describe_unknown: Optional[Callable[[str], str]] = None) -> None:
        self.setting = setting  # the config key that names a rule of this kind
        # A message for a name that is not here, when the kind has more to say than the list of names.
        self._describe_unknown = describe_unknown
        self._rules: dict[str, Rule] = {}
        for rule in rules:
            name = str(rule.name)  # type: ignore[attr-defined]
            if name in self._rules:
                raise ValueError(f"two {setting} rules are named {name!r}")
            self._rules[name] = rule

    def __getitem__(self, name: str) -> Rule:
        return self._rules[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._rules)

    def get_rule(self, rule: Union[str, Rule]) -> Rule:
        """The rule a name stands for (a rule object is returned as it is); ValueError listing the names there are."""
        if not isinstance(rule, str):
            return rule
        if rule not in self._rules:
            raise ValueError(self._unknown(rule, f"{self.setting} must be one of {', '.join(self._rules)}; got "
                                                 f"{rule!r}"))
        return self._rules[rule]

    def check_name(self, name: object) -> str:
        """`name` when it names a rule here; ValueError otherwise (the config's validator: names quoted)."""
        quoted = ", ".join(repr(known) for known in self._rules)
        if not isinstance(name, str) or name not in self._rules:
            raise ValueError(self._unknown(name, f"{self.setting} must be one of {quoted}; got {name!r}"))
        return name

    def _unknown(self, name: object, default: str) -> str:
        return self._describe_unknown(str(name)) if self._describe_unknown is not None else default
