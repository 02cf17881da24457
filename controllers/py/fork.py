"""fork: at the first step splits the request into N (arg, default 3) freely sampled sequences."""
from rudder_sdk import (CONFIG_FLAGS, CONFIG_MAX_FORKS, FLAG_FORKS, Branch, Controller, Refuse, config, log)


class Fork(Controller):
    def start(self, arg):
        text = arg.decode() or "3"
        if not text.isdigit():
            raise Refuse(f'fork: the argument must be a number, not "{text}"')
        self.n = int(text)
        allowed = config(CONFIG_FLAGS) & FLAG_FORKS
        if self.n < 1 or (self.n > 1 and (not allowed or self.n > config(CONFIG_MAX_FORKS))):
            raise Refuse(f"fork: cannot fork into {self.n} sequences")

    def mid_process(self, step):
        if step.index == 0:
            return [Branch.sample() for _ in range(self.n)]   # same logits, each fork samples on its own
        if step.index == 1:
            log(f"fork: this is fork {step.branch} of {self.n}")
        return Branch.sample()
