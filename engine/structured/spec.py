"""What a request's output must match: a plain, picklable description (no xgrammar here).

The gateway builds a ``GrammarSpec`` from ``response_format``, ``guided_*`` or a tool choice;
the engine compiles it (``engine/structured/compiler.py``). ``check`` parses the grammar without a
tokenizer, so a bad schema or regex is a 400 before anything is admitted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

from engine.errors import InvalidRequestError

GrammarKind = Literal["json", "json_schema", "regex", "choice"]
MAX_SPEC_CHARS = 100_000  # a schema, regex or choice list longer than this is refused
# xgrammar prefixes its messages with a time and a source location: the client needs neither.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """``kind`` json: any JSON object; json_schema: ``value`` is the schema as JSON text;
    regex: ``value`` is the pattern; choice: ``value`` is a JSON list of the allowed strings."""

    kind: GrammarKind
    value: str = ""

    @classmethod
    def json_schema(cls, schema: object) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, sort_keys=False, separators=(",", ":")))

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(options))

    @property
    def choices(self) -> list[str]:
        options: list[str] = json.loads(self.value) if self.kind == "choice" else []
        return options

    def ebnf(self) -> str:
        """A choice as an EBNF grammar: the root is one of the literal strings."""
        literals = " | ".join(json.dumps(option) for option in self.choices)
        return f"root ::= {literals}"

    def check(self, param: str) -> None:
        """Raise InvalidRequestError (naming ``param``) unless the grammar parses."""
        import xgrammar  # noqa: PLC0415 (lazy: xgrammar pulls triton; the gateway imports this)

        if len(self.value) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"{param} is longer than {MAX_SPEC_CHARS} characters", param)
        try:
            if self.kind == "json_schema":
                xgrammar.Grammar.from_json_schema(self.value)
            elif self.kind == "regex":
                xgrammar.Grammar.from_regex(self.value)
            elif self.kind == "choice":
                if not self.choices or any(not isinstance(c, str) or not c for c in self.choices):
                    raise InvalidRequestError(f"{param} must be a non-empty list of strings", param)
                xgrammar.Grammar.from_ebnf(self.ebnf())
        except InvalidRequestError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the reason
            lines = str(exc).strip().splitlines()
            reason = _LOCATION.sub("", lines[0]) if lines else type(exc).__name__
            raise InvalidRequestError(f"{param} is not a usable grammar: {reason}", param) from exc
