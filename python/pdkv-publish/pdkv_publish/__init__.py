"""Publish a trainer's weights to pdkv engines.

A :class:`Publisher` holds tensors by name in one buffer, answers
``GET /manifest`` over HTTP (every tensor's name, type, shape, place and
CRC-32) and serves the engines' one-sided reads over TCP in pdkv's transfer
protocol, after the KV-secret handshake. Point the engines at
:attr:`Publisher.url` with ``POST /init_weight_transfer_engine``; each one
pulls the tensors, checks every checksum, and switches at
``/finish_weight_update``.

Pure Python (standard library only). numpy arrays and torch CPU tensors are
taken as they are (float32); raw bytes with an explicit type name publish
any type the engine stores (``"q4_1"``, ``"q8_0"``, ...).
:func:`pdkv_publish.engine.call` makes the calls to the engines (or the
proxy) that drive a sync.
"""

from .publisher import Publisher, Tensor  # noqa: F401

__all__ = ["Publisher", "Tensor"]
