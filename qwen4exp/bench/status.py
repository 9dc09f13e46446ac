"""What a ``qwen4exp-bench`` run shares between its single-server path (``cli``) and its A/B of servers (``ab``): the
exit statuses and the run nonce (a module of its own, so that neither imports the other)."""

from __future__ import annotations

import secrets

EXIT_OK, EXIT_TURNS_FAILED, EXIT_SETUP = 0, 1, 2


def run_nonce(value: str | None) -> str:
    """``--run-nonce``: None -> a fresh random nonce; "none" -> none (the conversations repeat across runs)."""
    if value is None:
        return secrets.token_hex(4)
    return "" if value.lower() == "none" else value
