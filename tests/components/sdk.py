"""sdk: the Python SDK's cases for the tests, one component (a componentize-py build costs far
more than the code in it). The argument picks the case:

- "" : digits - the answer is a number of up to 6 digit tokens (controllers/py/digits.py);
- "fork N": the first step forks into N sequences (controllers/py/fork.py);
- "json SCHEMA": the sequence is handed to the built-in json controller, then stops
  (controllers/py/json_then_stop.py);
- "random": fast-forwards a random number, so the request's seed decides it;
- loop, memory, file, socket, env, log, branch, ff: misbehaves that way at its first step.
"""
import json
import os
import random
import socket

from rudder_sdk import (CONFIG_FLAGS, CONFIG_MAX_FORKS, FLAG_FORKS, Branch, Controller, HandOff, Refuse, TokenSet,
                        config, eos_token, log, tokenize)


def digit(state, byte):
    return state + 1 if 48 <= byte <= 57 else None


class Cases(Controller):
    def init(self):
        self.digits = TokenSet.from_trie(digit)
        eos = eos_token()
        self.digits_or_end = self.digits | TokenSet.of([eos] if eos is not None else [])

    def start(self, arg):
        self.mode, _, rest = arg.decode().partition(" ")
        if self.mode == "fork":
            if not rest.isdigit():
                raise Refuse(f'fork: the argument must be a number, not "{rest}"')
            self.n = int(rest)
            allowed = config(CONFIG_FLAGS) & FLAG_FORKS
            if self.n < 1 or (self.n > 1 and (not allowed or self.n > config(CONFIG_MAX_FORKS))):
                raise Refuse(f"fork: cannot fork into {self.n} sequences")
        if self.mode == "json":
            self.schema = json.loads(rest or "{}")
        self.handed = False

    def mid_process(self, step):
        mode = self.mode
        if mode == "":
            if len(step.generated) >= 6:
                return None
            return Branch.sample(self.digits_or_end if step.generated else self.digits)
        if mode == "fork":
            if step.index == 0:
                return [Branch.sample() for _ in range(self.n)]
            if step.index == 1:
                log(f"fork: this is fork {step.branch} of {self.n}")
            return Branch.sample()
        if mode == "json":
            if not self.handed:
                self.handed = True
                return HandOff.json(self.schema)
            return None
        if mode == "random":
            if step.generated:
                return None
            return Branch.fast_forward(tokenize(str(random.randrange(10 ** 9))))
        if mode == "loop":
            while True:
                pass
        if mode == "memory":
            hoard = []
            while True:
                hoard.append(bytearray(4 << 20))
        if mode == "file":
            with open("/etc/passwd") as f:       # no directory is preopened: this cannot work
                log("read", f.read())
        if mode == "socket":
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.connect(("127.0.0.1", 9))     # no network is granted
        if mode == "env":
            log("HOME is", os.environ["HOME"])  # the environment is empty
        if mode == "log":
            for _ in range(20):
                print("x" * 100_000)            # 2 MB into a log capped per request (well within the deadline)
        if mode == "branch":
            return Branch.sample(mask=b"\x01\x02\x03")   # a mask of the wrong size
        if mode == "ff":
            return Branch.fast_forward([10 ** 9])        # a token id past the vocabulary
        return Branch.sample()
