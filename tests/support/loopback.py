"""Loopback sockets that fail the way a media URL can: a port that accepts a connection and never answers."""

from __future__ import annotations

import contextlib
import socket
import threading


@contextlib.contextmanager
def stalling_port():
    """A 127.0.0.1 port whose server accepts connections and never answers, for as long as the context lasts."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    held, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for connection in held:
            connection.close()
        listener.close()
