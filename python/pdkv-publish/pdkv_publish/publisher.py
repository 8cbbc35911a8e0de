"""The publisher: a manifest over HTTP, reads over pdkv's transfer protocol."""

import hashlib
import hmac
import http.server
import json
import os
import secrets
import socket
import socketserver
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence, Tuple, Union

PROTOCOL = 1
ALIGN = 64

# The handshake every KV connection opens with (both ends prove they hold
# the deployment's secret without sending it).
HELLO, CHALLENGE, PROOF = b"PDKVAUTH", b"PDKVCHAL", b"PDKVPROF"
OKAY, DENY = b"PDKVOKAY", b"PDKVDENY"
HELLO_LEN, PROOF_LEN = 48, 40
PORT_TRANSFER = 1
SERVER_LABEL, CLIENT_LABEL = b"pdkv kv server", b"pdkv kv client"
DENY_NOT_HANDSHAKE, DENY_VERSION, DENY_WRONG_PORT, DENY_BAD_PROOF = 1, 2, 3, 4
MIN_SECRET_LEN = 16

# Frames: a 64-byte header (magic, version, kind, code, data length, op,
# segment, key, epoch, offset, len; little-endian), then the data.
MAGIC, VERSION, HEADER_LEN = b"PDKV", 1, 64
K_HELLO, K_READ_REQ, K_READ_RESP, K_ERROR = 1, 3, 5, 6
E_UNKNOWN_SEGMENT, E_BAD_KEY, E_STALE_EPOCH, E_OUT_OF_BOUNDS = 1, 3, 4, 5
MAX_DATA = 4 << 20
HEADER = struct.Struct("<4sBBHI4xQQQQQQ")


@dataclass
class Tensor:
    """One published tensor: its bytes as the engine stores them."""

    data: Union[bytes, bytearray, memoryview]
    dtype: str
    shape: Tuple[int, ...]


def _as_tensor(value) -> Tensor:
    if isinstance(value, Tensor):
        return value
    # torch CPU tensors: through numpy, without a copy when contiguous.
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        value = value.detach().cpu().numpy()
    if hasattr(value, "dtype") and hasattr(value, "tobytes"):
        name = str(value.dtype)
        if name != "float32":
            raise TypeError(f"arrays must be float32 (got {name}); pass a Tensor with raw bytes for other types")
        if not value.flags["C_CONTIGUOUS"]:
            value = value.copy(order="C")
        return Tensor(memoryview(value).cast("B"), "f32", tuple(int(d) for d in value.shape))
    raise TypeError(f"cannot publish {type(value).__name__}: give a numpy array, a torch tensor or a Tensor")


def _secret() -> bytes:
    s = os.environ.get("PDKV_KV_SECRET")
    if s is None:
        return b""
    if len(s) < MIN_SECRET_LEN:
        raise ValueError(f"the KV secret must be at least {MIN_SECRET_LEN} bytes long (got {len(s)})")
    return s.encode()


class Publisher:
    """Publishes ``tensors`` (name -> array or :class:`Tensor`) as ``version``.

    ``secret``: the deployment's KV secret (default: ``PDKV_KV_SECRET``, open
    when unset). Stop with :meth:`close` (or use it as a context manager).
    """

    def __init__(self, tensors: Dict[str, object], version: Optional[str] = None,
                 host: str = "127.0.0.1", http_port: int = 0, transfer_port: int = 0,
                 secret: Optional[str] = None):
        self._key = _secret() if secret is None else secret.encode()
        if secret is not None and len(secret) < MIN_SECRET_LEN:
            raise ValueError(f"the KV secret must be at least {MIN_SECRET_LEN} bytes long")
        entries, offset = [], 0
        parts = []
        for name, value in tensors.items():
            t = _as_tensor(value)
            n = len(memoryview(t.data).cast("B"))
            parts.append((offset, t))
            entries.append({"name": name, "dtype": t.dtype, "shape": list(t.shape),
                            "offset": offset, "len": n, "crc32": zlib.crc32(t.data) & 0xFFFFFFFF})
            offset = (offset + n + ALIGN - 1) // ALIGN * ALIGN
        self._buf = bytearray(max(offset, ALIGN))
        for (at, t), e in zip(parts, entries):
            self._buf[at:at + e["len"]] = memoryview(t.data).cast("B")
        self._view = memoryview(self._buf)
        self.segment, self.key, self.epoch = 1, secrets.randbits(64), 1
        self._transfer = _TransferServer((host, transfer_port), self)
        self._http = _HttpServer((host, http_port), self)
        self.bytes_served = 0
        self._lock = threading.Lock()
        th, tp = self._transfer.server_address[:2]
        self.manifest = {
            "protocol": PROTOCOL, "version": version, "transfer_addr": f"{th}:{tp}",
            "segment": self.segment, "key": self.key, "epoch": self.epoch, "tensors": entries,
        }
        self._manifest_bytes = json.dumps(self.manifest).encode()
        self._threads = [threading.Thread(target=s.serve_forever, daemon=True)
                         for s in (self._transfer, self._http)]
        for t in self._threads:
            t.start()

    @property
    def url(self) -> str:
        h, p = self._http.server_address[:2]
        return f"http://{h}:{p}"

    def total_bytes(self) -> int:
        return sum(t["len"] for t in self.manifest["tensors"])

    def close(self):
        for s in (self._http, self._transfer):
            s.shutdown()
            s.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- the transfer protocol ----

    def _mac(self, label: bytes, port: int, nonce_c: bytes, nonce_s: bytes) -> bytes:
        return hmac.new(self._key, label + bytes([port]) + nonce_c + nonce_s, hashlib.sha256).digest()

    def _handshake(self, sock: socket.socket) -> bool:
        hello = _recv_exact(sock, HELLO_LEN)
        if hello is None:
            return False
        if hello[:8] != HELLO:
            sock.sendall(DENY + bytes([DENY_NOT_HANDSHAKE]) + bytes(72 - 9))
            return False
        if hello[8] != 1:
            sock.sendall(DENY + bytes([DENY_VERSION]) + bytes(72 - 9))
            return False
        port = hello[9]
        if port != PORT_TRANSFER:
            sock.sendall(DENY + bytes([DENY_WRONG_PORT]) + bytes(72 - 9))
            return False
        nonce_c, nonce_s = hello[16:48], secrets.token_bytes(32)
        sock.sendall(CHALLENGE + nonce_s + self._mac(SERVER_LABEL, port, nonce_c, nonce_s))
        proof = _recv_exact(sock, PROOF_LEN)
        if proof is None or proof[:8] != PROOF:
            return False
        want = self._mac(CLIENT_LABEL, port, nonce_c, nonce_s)
        if not hmac.compare_digest(proof[8:40], want):
            sock.sendall(DENY + bytes([DENY_BAD_PROOF]) + bytes(7))
            return False
        sock.sendall(OKAY + bytes(8))
        return True

    def _serve(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self._handshake(sock):
            return
        total = len(self._buf)
        while True:
            h = _recv_exact(sock, HEADER_LEN)
            if h is None:
                return
            magic, version, kind, _code, data_len, op, seg, key, epoch, off, n = HEADER.unpack(h)
            if magic != MAGIC or version != VERSION or data_len != 0:
                return  # a frame we do not take closes the connection
            if kind == K_HELLO:
                sock.sendall(_header(K_HELLO, 0))
            elif kind == K_READ_REQ:
                err = None
                if seg != self.segment:
                    err = (E_UNKNOWN_SEGMENT, seg, 0, 0)
                elif key != self.key:
                    err = (E_BAD_KEY, seg, 0, 0)
                elif epoch != self.epoch:
                    err = (E_STALE_EPOCH, self.epoch, epoch, 0)
                elif n > MAX_DATA or off + n > total:
                    err = (E_OUT_OF_BOUNDS, off, n, total)
                if err is not None:
                    code, a, b, c = err
                    sock.sendall(_header(K_ERROR, op, code=code, segment=a, offset=b, length=c))
                    continue
                sock.sendall(_header(K_READ_RESP, op, data_len=n, length=n))
                sock.sendall(self._view[off:off + n])
                with self._lock:
                    self.bytes_served += n
            else:
                return


def _header(kind, op, code=0, data_len=0, segment=0, key=0, epoch=0, offset=0, length=0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, code, data_len, op, segment, key, epoch, offset, length)


def _recv_exact(sock: socket.socket, n: int) -> Optional[bytes]:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


class _TransferServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, publisher: Publisher):
        self.publisher = publisher
        super().__init__(addr, _TransferHandler)


class _TransferHandler(socketserver.BaseRequestHandler):
    def handle(self):
        try:
            self.server.publisher._serve(self.request)
        except (ConnectionError, OSError):
            pass


class _HttpServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr, publisher: Publisher):
        self.publisher = publisher
        super().__init__(addr, _HttpHandler)


class _HttpHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path != "/manifest":
            self.send_error(404, "GET /manifest")
            return
        body = self.server.publisher._manifest_bytes
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def read_safetensors(path: str) -> Dict[str, Tensor]:
    """The tensors of a float32 ``.safetensors`` file, as published tensors."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] != "F32":
            raise TypeError(f"{path}: tensor {name} is {meta['dtype']}; only F32 is read here")
        a, b = meta["data_offsets"]
        out[name] = Tensor(memoryview(data)[a:b], "f32", tuple(meta["shape"]))
    return out
