"""ControllerCursor: what a sequence's controller has been told, and what it must be told next.

The ABI reports changes since the previous `mid_process` call (docs/abi.md): which branch of its
last answer the sequence took, how many tokens were removed from its end, and the tokens appended
since. Every change to a sequence is reported here as it happens (`on_branch`, `on_append`,
`on_backtrack`, and for a draft `on_draft`), and `call()` turns what accumulated into the next
call's arguments. Two more pieces of state:

- `deferred`: a sampling Branch that also backtracked waits for the logits of a re-fed position
  (the step's logits are stale); it is sampled next step without calling the controller.
- `ahead`: tokens the controller was told that the sequence does not hold yet - a speculative
  draft, told token by token while drafting. Appending them for real consumes them; what is left
  when the draft is settled was rejected, and is reported as a backtrack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ..branch import Branch

__all__ = ["Controller", "ControllerCursor"]


class Controller(Protocol):
    """What the engine needs of a controller (the Wasm one, or a Python one in tests). A
    controller may also carry its request's `limits` (controller.Limits): the engine takes its
    progress budgets from there unless add_request is given limits."""

    def mid_process(self, branch_idx: int, backtrack: int, tokens: list[int]) -> "list[Branch]": ...

    def fork(self) -> "Controller": ...

    def close(self) -> None: ...


class ControllerCursor:
    __slots__ = ("controller", "branch", "backtrack", "appended", "ahead", "deferred", "started", "wait_until")

    def __init__(self, controller: Controller, prompt_ids: list[int]):
        self.controller = controller
        self.branch = 0  # the branch of the last answer this sequence took
        self.backtrack = 0  # tokens removed since the last call (that it had been told of)
        self.appended: list[int] = list(prompt_ids)  # the first call is told the prompt
        self.ahead = 0
        self.deferred: "Branch | None" = None
        self.started: "Future | None" = None  # a call already under way (the first: engine.add_request)
        self.wait_until = 0.0  # (perf_counter) how long the engine may wait for it before the prefill

    @property
    def wants_call(self) -> bool:
        """The controller is asked this step (not when a deferred Branch samples instead)."""
        return self.deferred is None

    def call(self) -> tuple[int, int, list[int]]:
        """The next mid_process call's (branch_idx, backtrack, tokens); nothing is pending after."""
        args = (self.branch, self.backtrack, self.appended)
        self.branch, self.backtrack, self.appended = 0, 0, []
        return args

    def on_branch(self, branch: int) -> None:
        """The sequence took branch `branch` of the controller's last answer."""
        self.branch = branch

    def on_append(self, tokens: list[int]) -> None:
        told = min(self.ahead, len(tokens))  # a draft's tokens: the controller knows them already
        self.ahead -= told
        self.appended.extend(tokens[told:] if told else tokens)

    def on_backtrack(self, n: int) -> None:
        assert not self.ahead, "a backtrack while a draft is unsettled"
        unreported = min(n, len(self.appended))  # appended since the last call: just forget them
        del self.appended[len(self.appended) - unreported:]
        self.backtrack += n - unreported

    def on_draft(self, tokens: list[int]) -> None:
        """The controller was told `tokens` as appended, ahead of the sequence (drafting)."""
        self.ahead += len(tokens)

    def settle_draft(self) -> None:
        """What is still ahead was not accepted: the controller's next call takes it back."""
        self.backtrack += self.ahead
        self.ahead = 0

    def defer(self, branch: "Branch") -> None:
        self.deferred = branch

    def take_deferred(self) -> "Branch | None":
        branch, self.deferred = self.deferred, None
        return branch

    def fork(self) -> "ControllerCursor":
        """The cursor of a new fork: a copy of the controller, and the same pending report."""
        child = ControllerCursor(self.controller.fork(), self.appended)
        child.backtrack = self.backtrack
        return child

    def close(self) -> None:
        self.controller.close()
