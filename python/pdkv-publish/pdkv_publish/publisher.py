"""The publisher: a manifest over HTTP, reads over pdkv's transfer protocol
(TCP), and the same memory shared with engines on this host (a memfd sent
over a Unix socket)."""

import hashlib
import hmac
import http.server
import itertools
import json
import mmap
import os
import secrets
import socket
import socketserver
import struct
import sys
import tempfile
import threading
import time
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
PORT_TRANSFER, PORT_SHM = 1, 2
SERVER_LABEL, CLIENT_LABEL = b"pdkv kv server", b"pdkv kv client"
DENY_NOT_HANDSHAKE, DENY_VERSION, DENY_WRONG_PORT, DENY_BAD_PROOF = 1, 2, 3, 4
MIN_SECRET_LEN = 16

# Frames: a 64-byte header (magic, version, kind, code, data length, op,
# segment, key, epoch, offset, len; little-endian), then the data.
MAGIC, VERSION, HEADER_LEN = b"PDKV", 1, 64
K_HELLO, K_READ_REQ, K_READ_RESP, K_ERROR = 1, 3, 5, 6
K_UNMAP, K_UNMAP_ACK, K_MAP_REQ, K_MAP_RESP, K_MAP_PART = 9, 10, 11, 12, 13
E_UNKNOWN_SEGMENT, E_BAD_KEY, E_STALE_EPOCH, E_OUT_OF_BOUNDS = 1, 3, 4, 5
MAX_DATA = 4 << 20
HEADER = struct.Struct("<4sBBHI4xQQQQQQ")
# How long close() waits for engines that mapped the memory to unmap it.
UNMAP_WAIT = 2.0
_socket_names = itertools.count()


@dataclass
class Tensor:
    """One published tensor: its bytes, as the engine stores them (a GGUF
    block type, ``f32``) or as a trainer holds them (``f32``, ``f16``,
    ``bf16``, Hugging Face order), with its type's name and shape."""

    data: Union[bytes, bytearray, memoryview]
    dtype: str
    shape: Tuple[int, ...]


# numpy's names (``ml_dtypes`` gives numpy its ``bfloat16``) -> the sync's.
_NUMPY_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def _as_tensor(value) -> Tensor:
    """A tensor as a trainer holds it: a numpy array (float32, float16, or
    ml_dtypes' bfloat16), a torch CPU tensor (float32, float16, bfloat16;
    torch is used through the tensor given, never imported here), or a
    :class:`Tensor` of raw bytes. Engines convert f16/bf16 (and f32 where
    they store another type) to the type they serve while they pull."""
    if isinstance(value, Tensor):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        t = value.detach().cpu().contiguous()
        if str(t.dtype) == "torch.bfloat16":
            # numpy has no bfloat16: the same bits, seen as 16-bit integers.
            torch = sys.modules[type(t).__module__.split(".")[0]]
            raw = t.view(torch.int16).numpy()
            return Tensor(memoryview(raw).cast("B"), "bf16", tuple(int(d) for d in t.shape))
        value = t.numpy()
    if hasattr(value, "dtype") and hasattr(value, "tobytes"):
        name = _NUMPY_DTYPES.get(str(value.dtype))
        if name is None:
            raise TypeError(f"arrays must be float32, float16 or bfloat16 (got {value.dtype}); "
                            "pass a Tensor with raw bytes for other types")
        if not value.flags["C_CONTIGUOUS"]:
            value = value.copy(order="C")
        if name == "bf16":
            value = value.view("uint16")
        return Tensor(memoryview(value).cast("B"), name, tuple(int(d) for d in value.shape))
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

    The tensors are copied into one memfd-backed buffer. Engines on another
    host read it over TCP; engines on this host map it (``shm=True``, the
    default: the memfd goes to them over a Unix socket) and copy it
    themselves. ``secret``: the deployment's KV secret (default:
    ``PDKV_KV_SECRET``, open when unset). Publish the next step's weights in
    place with :meth:`update`. Stop with :meth:`close` (or use it as a
    context manager).
    """

    def __init__(self, tensors: Dict[str, object], version: Optional[str] = None,
                 host: str = "127.0.0.1", http_port: int = 0, transfer_port: int = 0,
                 secret: Optional[str] = None, shm: bool = True):
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
                            "offset": offset, "len": n, "crc32": 0})
            offset = (offset + n + ALIGN - 1) // ALIGN * ALIGN
        # One memfd, a whole number of pages: what a map shares.
        self._size = max(-(-offset // mmap.PAGESIZE), 1) * mmap.PAGESIZE
        self._fd = os.memfd_create("pdkv-publish", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, self._size)
        self._mm = mmap.mmap(self._fd, self._size)
        self._view = memoryview(self._mm)
        self._entries = entries
        self._lock = threading.Lock()
        self._write(parts, version)
        self.segment, self.key, self.epoch = 1, secrets.randbits(64), 1
        self._transfer = _TransferServer((host, transfer_port), self)
        self._http = _HttpServer((host, http_port), self)
        self.bytes_served = 0
        self._shm_peers = {}  # socket -> set of mapped segments
        self._tcp_conns = set()
        self._unmap_acks = threading.Condition(self._lock)
        self._closing = False
        self._shm_path = None
        self._shm_sock = None
        if shm:
            path = os.path.join(tempfile.gettempdir(),
                                f"pdkv-publish-py-{os.getpid()}-{next(_socket_names)}.sock")
            if os.path.exists(path):
                os.unlink(path)
            self._shm_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._shm_sock.bind(path)
            os.chmod(path, 0o600)
            self._shm_sock.listen(64)
            self._shm_path = path
        th, tp = self._transfer.server_address[:2]
        self._transfer_addr = f"{th}:{tp}"
        self._publish_manifest(version)
        self._threads = [threading.Thread(target=s.serve_forever, daemon=True)
                         for s in (self._transfer, self._http)]
        if self._shm_sock is not None:
            self._threads.append(threading.Thread(target=self._shm_accept, daemon=True))
        for t in self._threads:
            t.start()

    def _write(self, parts, version):
        for (at, t), e in zip(parts, self._entries):
            data = memoryview(t.data).cast("B")
            self._view[at:at + e["len"]] = data
            e["crc32"] = zlib.crc32(self._view[at:at + e["len"]]) & 0xFFFFFFFF

    def _publish_manifest(self, version):
        m = {
            "protocol": PROTOCOL, "version": version, "transfer_addr": self._transfer_addr,
            "segment": self.segment, "key": self.key, "epoch": self.epoch,
            "tensors": [dict(e) for e in self._entries],
        }
        if self._shm_path is not None:
            m["shm"] = {"path": self._shm_path, "len": self._size}
        with self._lock:
            self.manifest = m
            self._manifest_bytes = json.dumps(m).encode()

    def update(self, tensors: Dict[str, object], version: Optional[str] = None):
        """Publishes the next weights in place: the same names, each with the
        same type, shape and size as before. Engines that mapped the memory
        keep their mapping; one that pulls while this writes finds a
        checksum that does not match and refuses the sync."""
        by_name = {e["name"]: e for e in self._entries}
        if set(tensors) != set(by_name):
            missing = sorted(set(by_name) - set(tensors))
            extra = sorted(set(tensors) - set(by_name))
            raise ValueError(f"update() takes the published names; missing {missing[:3]}, unknown {extra[:3]}")
        parts = []
        for e in self._entries:
            t = _as_tensor(tensors[e["name"]])
            n = len(memoryview(t.data).cast("B"))
            if (t.dtype, list(t.shape), n) != (e["dtype"], e["shape"], e["len"]):
                raise ValueError(f"tensor {e['name']}: {t.dtype} {list(t.shape)} ({n} bytes) "
                                 f"does not match the published {e['dtype']} {e['shape']} ({e['len']} bytes)")
            parts.append((e["offset"], t))
        self._write(parts, version)
        self._publish_manifest(version)

    @property
    def shm_path(self) -> Optional[str]:
        """The Unix socket engines on this host map the memory through."""
        return self._shm_path

    @property
    def url(self) -> str:
        h, p = self._http.server_address[:2]
        return f"http://{h}:{p}"

    def total_bytes(self) -> int:
        return sum(t["len"] for t in self.manifest["tensors"])

    def close(self):
        """Stops serving. Engines that mapped the memory are asked to unmap
        it first (a copy in progress ends, the next one fails), waiting at
        most ``UNMAP_WAIT`` seconds."""
        for s in (self._http, self._transfer):
            s.shutdown()
            s.server_close()
        if self._shm_sock is not None:
            deadline = time.monotonic() + UNMAP_WAIT
            with self._lock:
                self._closing = True
                holders = [p for p, segs in self._shm_peers.items() if segs]
                for i, p in enumerate(holders):
                    try:
                        p.sendall(_header(K_UNMAP, 1000 + i, segment=self.segment))
                    except OSError:
                        self._shm_peers[p] = set()
                while any(self._shm_peers.get(p) for p in holders):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._unmap_acks.wait(left)
                peers = list(self._shm_peers)
            _shutdown(peers)
            self._shm_sock.close()
            try:
                os.unlink(self._shm_path)
            except FileNotFoundError:
                pass
        with self._lock:
            conns = list(self._tcp_conns)
        _shutdown(conns)
        # The memfd's descriptor (the mapping holds the memory; mappings
        # engines still hold keep theirs).
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- the transfer protocol ----

    def _mac(self, label: bytes, port: int, nonce_c: bytes, nonce_s: bytes) -> bytes:
        return hmac.new(self._key, label + bytes([port]) + nonce_c + nonce_s, hashlib.sha256).digest()

    def _handshake(self, sock: socket.socket, expected: int = PORT_TRANSFER) -> bool:
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
        if port != expected:
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
        with self._lock:
            self._tcp_conns.add(sock)
        try:
            self._serve_tcp(sock)
        finally:
            with self._lock:
                self._tcp_conns.discard(sock)

    def _serve_tcp(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self._handshake(sock):
            return
        total = self._size
        for kind, op, seg, key, epoch, off, n in _frames(sock):
            if kind == K_HELLO:
                sock.sendall(_header(K_HELLO, 0))
            elif kind == K_READ_REQ:
                err = self._check(seg, key, epoch)
                if err is None and (n > MAX_DATA or off + n > total):
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


    # ---- shared memory ----

    def _shm_accept(self):
        while True:
            try:
                conn, _ = self._shm_sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._shm_serve_guarded, args=(conn,), daemon=True).start()

    def _shm_serve_guarded(self, sock: socket.socket):
        try:
            self._shm_serve(sock)
        except (ConnectionError, OSError):
            pass
        finally:
            with self._lock:
                self._shm_peers.pop(sock, None)
                self._unmap_acks.notify_all()
            sock.close()

    def _shm_serve(self, sock: socket.socket):
        sock.settimeout(10)
        if not self._handshake(sock, PORT_SHM):
            return
        sock.settimeout(None)
        with self._lock:
            if self._closing:
                return
            self._shm_peers[sock] = set()
        for kind, op, seg, key, epoch, _off, n in _frames(sock):
            if kind == K_MAP_REQ:
                err = self._check(seg, key, epoch)
                if err is None and n != self._size:
                    err = (E_OUT_OF_BOUNDS, 0, n, self._size)
                with self._lock:
                    if err is not None:
                        code, a, b, c = err
                        sock.sendall(_header(K_ERROR, op, code=code, segment=a, offset=b, length=c))
                        continue
                    if self._closing:
                        return
                    # The head: skew, registration length, chunks, bytes of
                    # all chunks; then one part: the first chunk's index and
                    # each chunk's length, with the memfd attached.
                    head = struct.pack("<QQQQ", 0, self._size, 1, self._size)
                    part = struct.pack("<QQ", 0, self._size)
                    self._shm_peers[sock].add(seg)
                    sock.sendall(_header(K_MAP_RESP, op, data_len=len(head), length=len(head)) + head)
                    socket.send_fds(sock, [_header(K_MAP_PART, op, data_len=len(part), length=len(part)) + part],
                                    [self._fd])
            elif kind == K_UNMAP_ACK:
                with self._lock:
                    self._shm_peers.get(sock, set()).discard(seg)
                    self._unmap_acks.notify_all()
            else:
                return

    def _check(self, seg, key, epoch):
        if seg != self.segment:
            return (E_UNKNOWN_SEGMENT, seg, 0, 0)
        if key != self.key:
            return (E_BAD_KEY, seg, 0, 0)
        if epoch != self.epoch:
            return (E_STALE_EPOCH, self.epoch, epoch, 0)
        return None


def _frames(sock: socket.socket):
    """The headers a peer sends, as (kind, op, segment, key, epoch, offset,
    len), until it closes or sends a frame neither side of the publisher
    takes (one with data, or another magic or version)."""
    while True:
        h = _recv_exact(sock, HEADER_LEN)
        if h is None:
            return
        magic, version, kind, _code, data_len, op, seg, key, epoch, off, n = HEADER.unpack(h)
        if magic != MAGIC or version != VERSION or data_len != 0:
            return
        yield kind, op, seg, key, epoch, off, n


def _shutdown(socks):
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


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


_SAFETENSORS_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}


def read_safetensors(path: str) -> Dict[str, Tensor]:
    """The tensors of a ``.safetensors`` file (F32, F16 or BF16), as
    published tensors in the file's types."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise TypeError(f"{path}: tensor {name} is {meta['dtype']}; F32, F16 or BF16 are read")
        a, b = meta["data_offsets"]
        out[name] = Tensor(memoryview(data)[a:b], dtype, tuple(meta["shape"]))
    return out
