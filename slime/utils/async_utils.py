"""One persistent asyncio loop in a daemon thread, so HTTP clients and semaphores survive across calls."""

import asyncio
import threading

_loop = None
_lock = threading.Lock()


def get_async_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="slime-async-loop", daemon=True).start()
        return _loop


def run(coro, timeout=None):
    """Run `coro` on the background loop and block until it finishes (or `timeout` seconds pass)."""
    future = asyncio.run_coroutine_threadsafe(coro, get_async_loop())
    try:
        return future.result(timeout)
    except TimeoutError:
        if future.done():  # the coroutine's own TimeoutError, not this wait's
            raise
        future.cancel()
        raise TimeoutError(
            f"coroutine {getattr(coro, '__qualname__', coro)} did not finish within {timeout}s"
        ) from None
