"""digits: the answer is a number (up to 6 tokens of digits), as the README's C controller."""
from rudder_sdk import Branch, Controller, TokenSet, eos_token


def digit(state, byte):
    return state + 1 if 48 <= byte <= 57 else None   # a byte-level recognizer: None rejects


class Digits(Controller):
    def init(self):                                   # once per module and tokenizer, then saved
        self.digits = TokenSet.from_trie(digit)       # every token made only of digits
        eos = eos_token()
        self.digits_or_end = self.digits | TokenSet.of([eos] if eos is not None else [])

    def mid_process(self, step):
        if len(step.generated) >= 6:
            return None                               # no branch: the sequence stops
        # may end after the first digit
        return Branch.sample(self.digits_or_end if step.generated else self.digits)
