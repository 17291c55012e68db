"""The gRPC server every role and the router start: a taken port is an error, not a shared one."""

from __future__ import annotations

import asyncio

import pytest

from blockspec.common.grpc_server import start_server


def test_a_second_server_on_a_taken_port_fails_to_bind():
    """grpc turns SO_REUSEPORT on by default: two servers then both listen on one port and the kernel splits the
    clients between them. Ours turn it off."""
    async def run():
        first, _, port = await start_server(lambda s: None, (), "127.0.0.1", 0)
        try:
            with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}"):
                await start_server(lambda s: None, (), "127.0.0.1", port)
        finally:
            await first.stop(0)

    asyncio.run(run())
