"""Token healing (docs/constraints.md, "Token healing"): a prompt that ends mid-word, or with a
space, ends with a token the model would rarely have chosen there (`https` + `:` where it writes
`://`; `" "` where it writes `" Paris"`). With `SamplingParams(token_healing=True)` the prompt's
last tokens are taken back and the output writes their text again first, in tokens of the model's
choice.

The host decides how many tokens (`plan`), and tells the controller through the ABI's
`config(CONFIG_HEAL)` (`tell`); the guest SDK's token layer answers the first step with that
backtrack and a mask of the tokens that write the taken-back bytes again (then, with a constraint,
bytes that continue it), so healing goes through the same backtrack and mask as every other
controller answer. The built-in constraint controllers heal, and `heal` does it with no constraint.
The engine checks the first answer's backtrack (engine/branching.py) and leaves the taken-back text
out of the output it shows (engine/output.py, TextOutput).
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

__all__ = ["HEALING_CONTROLLERS", "Healing", "check_chat", "check_controller", "plan", "tell"]

#: The built-in controllers whose token layer heals (guest-sdk/rudder_constraint.c).
HEALING_CONTROLLERS = frozenset({"heal", "json", "regex", "choices", "grammar"})

# Per tokenizer: the bytes of its ordinary tokens, sorted (the tokens that start with some bytes
# follow those bytes in this order), and the longest one's length.
_sorted_tokens: "weakref.WeakKeyDictionary[Tokenizer, tuple[list[bytes], int]]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Healing:
    """What a request takes back: its prompt's last `tokens` tokens, whose text is `text`."""

    tokens: int
    text: str


def _sorted(tokenizer: "Tokenizer") -> tuple[list[bytes], int]:
    found = _sorted_tokens.get(tokenizer)
    if found is None:
        special = tokenizer.special_token_ids
        table = sorted({b for i, b in enumerate(tokenizer.token_bytes) if b and i not in special})
        found = _sorted_tokens[tokenizer] = (table, max(map(len, table), default=0))
    return found


def _longer_token_starts_with(table: list[bytes], data: bytes) -> bool:
    i = bisect.bisect_right(table, data)
    return i < len(table) and table[i].startswith(data)


def plan(tokenizer: "Tokenizer", prompt_ids: list[int]) -> Healing | None:
    """The prompt tokens worth taking back: the most last tokens whose bytes together begin some
    longer token of the vocabulary (so the model could write them and more in one token), whole
    UTF-8 characters, never a special token and never the whole prompt. None: nothing helps."""
    table, special = tokenizer.token_bytes, tokenizer.special_token_ids
    data, longest = _sorted(tokenizer)
    best, tail = 0, b""
    for k in range(1, len(prompt_ids)):
        token = prompt_ids[-k]
        if token in special or not table[token]:
            break
        tail = table[token] + tail
        if len(tail) >= longest:
            break
        if _longer_token_starts_with(data, tail) and _utf8(tail):
            best = k
    if not best:
        return None
    decoder = tokenizer.stream_decoder()  # the text exactly as the output's decoder will write it
    return Healing(best, decoder.push(prompt_ids[-best:]) + decoder.flush())


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def check_controller(controller, source: str | None = None) -> None:
    """Refuse token healing with a controller that does not heal (ValueError naming the field):
    the built-in constraint controllers and `heal` do; a user's own module, and the `triggers`
    controller that structural tags and reasoning use, do not. `source`: the field that chose the
    controller, named in the message."""
    if isinstance(controller, str) and controller in HEALING_CONTROLLERS:
        return
    what = source or (repr(controller) if isinstance(controller, str) else "a controller module")
    raise ValueError(f"token_healing: works with the built-in constraints (json_schema, regex, choice, grammar) or "
                     f"none; {what} does not heal")


def check_chat(params, chat: bool) -> None:
    """Refuse token healing for a chat prompt: it ends with the template's assistant header, not
    with text of the user's to heal."""
    if chat and params is not None and params.token_healing:
        raise ValueError("token_healing: a chat prompt ends with the chat template's assistant header, not with "
                         "text to heal; heal a plain prompt")


def tell(controller, healing: Healing) -> None:
    """Tell a started Wasm controller (core module or component) what its first answer takes back:
    the value of its `config(CONFIG_HEAL)` (docs/abi.md)."""
    request = getattr(controller, "request", None)
    if request is None or not hasattr(request, "heal"):
        raise ValueError("token_healing: needs a Wasm controller that heals (the built-in constraints, or `heal`)")
    request.heal = healing.tokens
