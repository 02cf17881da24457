"""The controller sandbox: runs untrusted WebAssembly controllers (docs/abi.md) that steer
decoding token by token.

    runtime = ControllerRuntime(tokenizer)          # one per LLM/server
    module = runtime.load(wasm_bytes_or_path)       # validated, compiled, cached by sha256
    ctl = runtime.start(module, arg, limits)        # one per request (rudder_init runs once)
    branches = ctl.mid_process(branch_idx, backtrack, tokens)   # each step
    child = ctl.fork(); ctl.close()

Modules: limits (Limits), errors (ControllerError), fastcall (cffi binding of wasmtime's C
API), host_api (the `rudder` imports), token_table (RTT1), module / module_cache (loading
and compiled-code cache), instance (one Store), snapshot (post-init state, forks),
result (reading Branch records), controller (Controller), runtime (ControllerRuntime).
"""

from .controller import Controller
from .errors import ControllerError
from .host_api import RequestContext
from .limits import Limits
from .module import ControllerModule
from .runtime import ControllerRuntime
from .token_table import build_token_table, token_table_for

__all__ = ["Controller", "ControllerError", "ControllerModule", "ControllerRuntime", "Limits",
           "RequestContext", "build_token_table", "token_table_for"]
