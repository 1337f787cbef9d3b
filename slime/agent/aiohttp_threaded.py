"""Serve an aiohttp app from a daemon thread with its own event loop (an adapter beside a rollout's own loop)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

from aiohttp import web


@dataclasses.dataclass
class AppHandle:
    host: str
    port: int
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    runner: web.AppRunner

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)


def run_app_in_thread(
    app: web.Application,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    timeout: float = 30.0,
    name: str = "slime-agent-app",
    cancel_on_disconnect: bool = False,
) -> AppHandle:
    """Start `app` on host:port (0 picks a free port) and return once it accepts connections. With
    `cancel_on_disconnect` a client that disconnects cancels its handler."""
    loop = asyncio.new_event_loop()
    ready: dict = {}
    started = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        try:
            runner = web.AppRunner(app, access_log=None, handler_cancellation=cancel_on_disconnect)
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, host, port)
            loop.run_until_complete(site.start())
            ready["runner"] = runner
            ready["port"] = runner.addresses[0][1]
        except BaseException as e:  # handed to the caller, which raises it
            ready["error"] = e
            started.set()
            return
        started.set()
        loop.run_forever()
        loop.run_until_complete(loop.shutdown_asyncgens())  # as asyncio.run: closes e.g. http_utils' session
        loop.close()

    thread = threading.Thread(target=serve, name=name, daemon=True)
    thread.start()
    if not started.wait(timeout):
        raise TimeoutError(f"the app did not start on {host}:{port} within {timeout}s")
    if "error" in ready:
        raise ready["error"]
    return AppHandle(host, ready["port"], loop, thread, ready["runner"])
