"""The plugin's loggers.  Imports no vLLM.

vLLM configures one logger, "vllm": its handler and format, VLLM_LOGGING_LEVEL, or a
user's VLLM_LOGGING_CONFIG_PATH; it stops its records there (propagate False).  A
logger named after a plugin module alone has no handler in a vLLM process, so its
INFO lines would go nowhere and its warnings out unformatted.  The plugin's loggers
are children of "vllm", so a server's log shows their lines as it shows vLLM's own,
under the same settings; outside vLLM they propagate to the root logger as any
library's do."""

from __future__ import annotations

import logging

PARENT = "vllm"


def get_logger(module: str) -> logging.Logger:
    """The logger of the plugin module named `module` (its __name__)."""
    return logging.getLogger(f"{PARENT}.{module}")
