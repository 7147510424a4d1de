"""An update order as the control plane signs one (before signing), for the tests of the order
format and of the root helper that checks it."""

from __future__ import annotations

import time
from typing import Any

NODE = "gpu-1"


def order_for(**changes: Any) -> dict[str, Any]:
    order: dict[str, Any] = {
        "node_id": NODE,
        "version": "0.2.0",
        "counter": 1,
        "sha256": "0" * 64,
        "url": "http://127.0.0.1:8080/agent/bundles/linux-x64.tar.gz",
        "arch": "x64",
        "expires": int(time.time()) + 3600,
    }
    order.update(changes)
    return order
