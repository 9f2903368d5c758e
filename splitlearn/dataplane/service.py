"""The trunk's gRPC service: ``Trunk/Exchange`` of trunk.proto over a :class:`TrunkEndpoint`.

Frames travel as raw bytes and are parsed by the endpoint, so a frame that does
not parse is refused with a reason instead of ending the stream. The service
bounds what any client can hold: at most ``max_streams`` streams in all (more are
refused at once with RESOURCE_EXHAUSTED rather than queued behind busy workers),
at most ``dataplane.streams_per_token`` per token, and a watchdog closes streams that
are idle or whose token was revoked or expired.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc

from splitlearn.dataplane.endpoint import SessionRefused, TrunkEndpoint
from splitlearn.dataplane.node_keys import PROOF_METADATA_KEY

log = logging.getLogger(__name__)

#: Full method name of the bidirectional stream (see trunk.proto).
EXCHANGE_METHOD = "/splitlearn.dataplane.v1.Trunk/Exchange"
#: gRPC metadata key carrying the session token.
TOKEN_METADATA_KEY = "x-splitlearn-token"


class TrunkService:
    """gRPC server exposing a :class:`TrunkEndpoint`.

    Parameters
    ----------
    endpoint : TrunkEndpoint
        Handles the frames.
    host : str
        Interface to bind.
    port : int
        Port to bind; 0 picks a free one.
    advertise_host : str, optional
        Host clients should dial (e.g. a public name); defaults to ``host``.
    server_credentials : grpc.ServerCredentials, optional
        TLS credentials; insecure when None.
    max_streams : int
        Streams served at once; each holds a worker thread.
    watchdog_s : float
        How often idle and revoked streams are looked for.
    """

    def __init__(
        self,
        endpoint: TrunkEndpoint,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        server_credentials: grpc.ServerCredentials | None = None,
        max_streams: int = 64,
        watchdog_s: float = 1.0,
    ) -> None:
        self.endpoint = endpoint
        limit = 2 * endpoint.dataplane.max_frame_bytes  # headroom: oversize gets a reasoned refusal
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="trunk"),
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ],
            maximum_concurrent_rpcs=max_streams,
        )
        handler = grpc.stream_stream_rpc_method_handler(self._exchange)
        service, method = EXCHANGE_METHOD.strip("/").split("/")
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),)
        )
        bind = f"{host}:{port}"
        if server_credentials is None:
            self.port = self._server.add_insecure_port(bind)
        else:
            self.port = self._server.add_secure_port(bind, server_credentials)
        if self.port == 0:
            raise OSError(f"trunk service could not bind {bind}")
        self.address = f"{advertise_host or host}:{self.port}"
        self._watchdog_s = watchdog_s
        self._stopping = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="trunk-watchdog", daemon=True)

    def _exchange(
        self, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        metadata = dict(context.invocation_metadata())
        token, proof = metadata.get(TOKEN_METADATA_KEY), metadata.get(PROOF_METADATA_KEY)
        try:
            session, stream = self.endpoint.attach(
                token if isinstance(token, str) else None, context.cancel,
                proof=proof if isinstance(proof, bytes) else None)
        except SessionRefused as refused:
            context.abort(getattr(grpc.StatusCode, refused.code), str(refused))
        peer = context.peer()
        half_closed = False
        try:
            for data in requests:
                yield self.endpoint.handle(session, data, peer=peer)
            # The requests also run out on a cancel that gRPC had not marked when it read
            # the stream's end; one marked since shows here. (Some cancels still pass for a
            # half-close: gRPC's sync API does not tell them apart.)
            half_closed = context.is_active()
        except grpc.RpcError:
            pass  # the client vanished or the stream was closed (revoked, idle)
        finally:
            # A cancel while a reply is being sent makes gRPC close this generator
            # (GeneratorExit) without an RpcError, so only a half-close counts as a clean
            # end. Every trunk step is atomic: an abrupt end has nothing to undo.
            if not half_closed:
                log.info("data plane: a stream of client %s ended abruptly", session.grant.client)
            self.endpoint.detach(session, stream)

    def _watch(self) -> None:
        while not self._stopping.wait(self._watchdog_s):
            closed = self.endpoint.close_idle()
            if closed:
                log.info("data plane: closed %d idle or revoked session(s)", closed)

    def start(self) -> str:
        """Start serving; return the address clients should dial."""
        self._server.start()
        self._watchdog.start()
        log.info("trunk service listening on %s", self.address)
        return self.address

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving: open streams get ``grace_s`` seconds, the whole stop a bounded wait."""
        self._stopping.set()
        if not self._server.stop(grace_s).wait(timeout=grace_s + 5.0):
            log.warning("trunk service: streams still running %.0f s after stop", grace_s + 5.0)
