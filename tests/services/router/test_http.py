"""The router's HTTP side: /health and /metrics answer while another connection sits idle."""

from __future__ import annotations

import socket
import urllib.request

from blockspec.services.router.http import start_http


def test_an_idle_connection_does_not_hold_up_the_health_probe():
    server = start_http("127.0.0.1", 0, lambda: (True, "ready\n"))
    port = server.server_port
    idle = socket.create_connection(("127.0.0.1", port))  # connected, sends nothing (a stuck scraper)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            assert resp.status == 200 and resp.read() == b"ready\n"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200
    finally:
        idle.close()
        server.shutdown()
        server.server_close()
