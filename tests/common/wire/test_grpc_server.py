"""The gRPC server every role and the router start: a taken port is an error, not a shared one."""

from __future__ import annotations

import asyncio

import pytest

from blockspec.common.wire.grpc_server import start_server


def test_a_second_server_on_a_taken_port_fails_to_bind():
    """grpc turns SO_REUSEPORT on by default: two servers then both listen on one port and the kernel splits the
    clients between them. Ours turn it off."""
    async def run():
        first, _, port = await start_server(lambda s: None, (), "127.0.0.1", 0)
        try:
            with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port} \\(Address already in use\\)"):
                await start_server(lambda s: None, (), "127.0.0.1", port)
        finally:
            await first.stop(0)

    asyncio.run(run())


@pytest.mark.parametrize("host, unix_socket, message", [
    ("192.0.2.1", None, "cannot bind 192.0.2.1:0 (Cannot assign requested address)"),  # TEST-NET-1: never ours
    ("no-such-host.invalid", None, "cannot bind no-such-host.invalid:0 ("),
    ("127.0.0.1", "/no/such/dir/role.sock", "cannot bind unix:/no/such/dir/role.sock (no such directory)"),
])
def test_an_address_that_cannot_be_bound_says_why(host, unix_socket, message):
    """grpc only says it failed; the error names the system's reason (not a guess that the port is taken)."""
    async def run():
        with pytest.raises(OSError) as caught:
            await start_server(lambda s: None, (), host, 0, unix_socket)
        assert message in str(caught.value) and "in use" not in str(caught.value), caught.value

    asyncio.run(run())
