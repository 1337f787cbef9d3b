"""A local (127.0.0.1) HTTP server of images, redirects, large and slow bodies: what image URLs are fetched from."""

import http.server
import io
import threading
import time

import torch
from PIL import Image

IMAGE_SIZE = (56, 84)


class Media(http.server.BaseHTTPRequestHandler):
    """/img (an image's bytes), /hop/N (a redirect to /hop/N-1, /hop/0 to /img), /to/HOST (a redirect to /img on
    HOST), /stream/N (N bytes without a Content-Length), /slow (waits 3 s), /drip/body (the image in DRIP_PIECES pieces
    DRIP_PAUSE s apart: each read gets bytes well within any timeout, the whole body takes 5 s; /drip/unsized the
    same without a Content-Length; /drip/headers as many header lines as slowly, then the image), /gate (the image
    once the test opens the gate), else 404."""

    image = b""
    DRIP_PIECES, DRIP_PAUSE = 20, 0.25
    drip_done = threading.Event()  # set when a /drip handler returns
    entered, gate = threading.Event(), threading.Event()  # /gate: set `entered`, then wait for `gate`

    def do_GET(self):
        parts = self.path.strip("/").split("/")
        if parts[0] == "img":
            return self._send(200, self.image)
        if parts[0] == "hop":
            n = int(parts[1])
            return self._redirect(f"/hop/{n - 1}" if n else "/img")
        if parts[0] == "to":
            return self._redirect(f"http://{parts[1]}:{self.server.server_port}/img")
        if parts[0] == "stream":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"x" * int(parts[1]))
            return None
        if parts[0] == "gate":
            self.entered.set()
            self.gate.wait(30)
            return self._send(200, self.image)
        if parts[0] == "drip":
            return self._drip(parts[1])
        if parts[0] == "slow":
            time.sleep(3)
            return self._send(200, self.image)
        return self._send(404, b"")

    def _send(self, code, body):
        try:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # /slow: the client gave up
            pass

    def _drip(self, mode):
        step = -(-len(self.image) // self.DRIP_PIECES)
        pieces = [self.image[i : i + step] for i in range(0, len(self.image), step)]
        try:
            self.send_response(200)
            if mode == "headers":
                self.flush_headers()  # the status line
                for i in range(self.DRIP_PIECES):
                    self.wfile.write(f"X-Drip-{i}: {i}\r\n".encode())
                    self.wfile.flush()
                    time.sleep(self.DRIP_PAUSE)
            if mode != "unsized":
                self.send_header("Content-Length", str(len(self.image)))
            self.end_headers()
            for piece in pieces:
                self.wfile.write(piece)
                self.wfile.flush()
                if mode != "headers":
                    time.sleep(self.DRIP_PAUSE)
        except OSError:  # the client gave up: stop at the next piece
            self.close_connection = True
        finally:
            self.drip_done.set()

    def _redirect(self, location):
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def serve():
    """The `media_host` fixture's body: yields http://127.0.0.1:PORT of a local server of the handler above, its
    image a random IMAGE_SIZE PNG (seed 0, as tests/test_vlm_server.py's `_image`)."""
    g = torch.Generator().manual_seed(0)
    pixels = (torch.rand(IMAGE_SIZE[1], IMAGE_SIZE[0], 3, generator=g) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    Media.image = buf.getvalue()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Media)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    thread.join(10)
