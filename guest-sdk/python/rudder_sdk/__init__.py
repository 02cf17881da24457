"""The rudder guest SDK for Python controllers (docs/components.md).

A controller is a class with one required method, called once per decoding step:

    from rudder_sdk import Controller, Branch, TokenSet

    class Digits(Controller):
        def init(self):                       # once per module and tokenizer (then saved)
            self.digits = TokenSet.from_trie(lambda state, byte: state if 48 <= byte <= 57 else None)

        def mid_process(self, step):
            if len(step.generated) >= 6:
                return None                   # no branch: the sequence stops
            mask = self.digits | TokenSet.of([eos_token()]) if step.generated else self.digits
            return Branch.sample(mask)

`rudder build digits.py -o digits.wasm` makes the component. The controller object is the
state: every request starts from it as `init` left it, and every fork gets a copy (it is
pickled), so keep state on `self`, not in module globals.
"""

from __future__ import annotations

from ._sdk import (Branch, Controller, HandOff, Refuse, Step, TokenSet, arg, config, detokenize, eos_token, log,
                   token_bytes, tokenize, var_get, var_set, vocab_size)
from ._trie import Trie

__all__ = ["Branch", "Controller", "HandOff", "Refuse", "Step", "TokenSet", "Trie", "arg", "config", "detokenize",
           "eos_token", "log", "token_bytes", "tokenize", "var_get", "var_set", "vocab_size",
           "CONFIG_ABI_VERSION", "CONFIG_MAX_FORKS", "CONFIG_MAX_FF_TOKENS", "CONFIG_FLAGS", "FLAG_FORKS",
           "FLAG_BACKTRACK"]

CONFIG_ABI_VERSION, CONFIG_MAX_FORKS, CONFIG_MAX_FF_TOKENS, CONFIG_FLAGS = 0, 1, 2, 3
FLAG_FORKS, FLAG_BACKTRACK = 1, 2
