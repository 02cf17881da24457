"""hostile: misbehaves in the way its argument names, at its first step (tests only)."""
import os
import socket

from rudder_sdk import Branch, Controller, log


class Hostile(Controller):
    def start(self, arg):
        self.mode = arg.decode()

    def mid_process(self, step):
        mode = self.mode
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
            for _ in range(200):
                print("x" * 100_000)            # 20 MB into a log capped per request
        if mode == "branch":
            return Branch.sample(mask=b"\x01\x02\x03")   # a mask of the wrong size
        if mode == "ff":
            return Branch.fast_forward([10 ** 9])        # a token id past the vocabulary
        return Branch.sample()
