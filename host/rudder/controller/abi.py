"""The controller ABI's constants, in one place (docs/abi.md is the specification; the C twin is
guest-sdk/rudder.h). The loader, the host functions, the result decoder and the token table
all take their names, signatures, keys and layouts from here."""

from __future__ import annotations

import struct

__all__ = ["ABI_VERSION", "IMPORT_MODULE", "IMPORTS", "FUNC_EXPORTS", "MEMORY_EXPORT", "CONFIG_ABI_VERSION",
           "CONFIG_MAX_FORKS", "CONFIG_MAX_FF_TOKENS", "CONFIG_FLAGS", "CONFIG_HEAL", "FLAG_FORKS", "FLAG_BACKTRACK",
           "RESULT", "BRANCH", "TOKENS", "TOKEN_TABLE_MAGIC", "TOKEN_TABLE_HEADER_WORDS"]

ABI_VERSION = 1

# The one module a controller may import from: name -> (number of i32 params, number of i32 results).
IMPORT_MODULE = "rudder"
IMPORTS: dict[str, tuple[int, int]] = {
    "vocab_size": (0, 1), "eos_token": (0, 1), "config": (1, 1),
    "arg_len": (0, 1), "arg_read": (2, 1),
    "tokenize": (4, 1), "token_table_len": (0, 1), "token_table_read": (2, 1),
    "log": (2, 0), "var_get": (4, 1), "var_set": (4, 1),
}

# Exports: the linear memory and these functions, name -> (i32 params, i32 results).
MEMORY_EXPORT = "memory"
FUNC_EXPORTS: dict[str, tuple[int, int]] = {
    "rudder_abi_version": (0, 1), "rudder_init": (0, 1), "rudder_start": (0, 1),
    "rudder_input": (1, 1), "rudder_mid_process": (3, 1),
}

# Keys of the `config` import, and the bits of its flags word.
CONFIG_ABI_VERSION, CONFIG_MAX_FORKS, CONFIG_MAX_FF_TOKENS, CONFIG_FLAGS = 0, 1, 2, 3
# The prompt tokens the controller's first answer takes back (token healing; 0: none).
CONFIG_HEAL = 4
FLAG_FORKS, FLAG_BACKTRACK = 1, 2

# Records read out of guest memory (all fields u32, little-endian).
RESULT = struct.Struct("<II")     # rudder_result: n_branches, branches
BRANCH = struct.Struct("<IIII")   # rudder_branch: backtrack, mask, n_ff, ff
TOKENS = struct.Struct("<II")     # rudder_tokens: n, tokens

# The token table (docs/abi.md, "The token table").
TOKEN_TABLE_MAGIC = 0x31545452  # "RTT1" little-endian
TOKEN_TABLE_HEADER_WORDS = 4    # magic, vocab_size, n_nodes, bytes_len
