"""The server's listening socket (serve/server.py `bind`): the connections asyncio accepts on it send small
writes at once (TCP_NODELAY). Without it a reply written in two parts (uvicorn writes a response's headers, then its
body) waited for the client's delayed ACK: about 40 ms on every request of a kept-alive connection, which the
`openai` client (httpx) reuses."""

import asyncio
import socket

from shardlm.serve.server import bind


def test_accepted_connections_send_small_writes_at_once():
    sock = bind("127.0.0.1", 0)
    seen = {}

    async def main():
        async def on_connect(reader, writer):
            conn = writer.get_extra_info("socket")
            seen["nodelay"] = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*sock.getsockname()[:2]), 10)
            await asyncio.wait_for(reader.read(), 10)  # the server closed it: on_connect has run
            writer.close()

    asyncio.run(main())
    assert seen.get("nodelay", 0) != 0, "accepted connections keep Nagle's algorithm on (TCP_NODELAY unset)"
