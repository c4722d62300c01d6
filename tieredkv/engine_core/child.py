"""The engine process's main loop: requests in, one message of output deltas per step out.

A receiver thread reads the connection into a queue the whole time, so the server never waits
for a step to end to send; the loop takes what arrived between two steps, steps while there is
work, and blocks on the queue when there is none. The server closing its end (or dying) ends
the process.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import threading
from multiprocessing.connection import Connection

from tieredkv.config import EngineConfig
from tieredkv.engine import LLMEngine
from tieredkv.engine_core import NewRequest
from tieredkv.engine_core.deltas import DeltaEncoder
from tieredkv.engine_core.info import EngineInfo
from tieredkv.engine_core.messages import (
    Abort,
    Call,
    Closed,
    Ready,
    Rejected,
    Reply,
    Shutdown,
    StartFailed,
    StepFailed,
    StepOutputs,
    portable,
)
from tieredkv.outputs import RequestOutput

logger = logging.getLogger(__name__)

Inbound = NewRequest | Abort | Call | Shutdown


def run_engine(config: EngineConfig, conn: Connection) -> None:
    """Build the engine, say `Ready` (or `StartFailed`), serve until `Shutdown` or the server
    closes the connection; then release the tiers and say `Closed`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which stops this process
    try:
        engine = LLMEngine(config)
    except BaseException as err:
        conn.send(StartFailed(portable(err)))
        return
    try:
        conn.send(Ready(EngineInfo.of(engine)))
        inbox: queue.SimpleQueue[Inbound] = queue.SimpleQueue()
        threading.Thread(target=_receive, args=(conn, inbox), name="tieredkv-engine-inbox", daemon=True).start()
        EngineLoop(engine, conn, inbox).run()
    finally:
        engine.close()
    with contextlib.suppress(OSError):  # the server may be gone
        conn.send(Closed(engine.stats()))


def _receive(conn: Connection, inbox: queue.SimpleQueue[Inbound]) -> None:
    """Move messages from the connection to the queue; a closed connection is a `Shutdown`."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(Shutdown())


class EngineLoop:
    """Applies the server's messages between steps and sends each step's outputs as deltas."""

    def __init__(self, engine: LLMEngine, conn: Connection, inbox: queue.SimpleQueue[Inbound]) -> None:
        self.engine, self.conn, self.inbox = engine, conn, inbox
        self.encoder = DeltaEncoder()

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished()
            tend_again_s = None if busy else self.engine.tend_tiers()  # the tiers' I/O goes on between requests
            outputs: list[RequestOutput] = []
            for message in self._arrived(block=not busy, timeout=tend_again_s):
                if isinstance(message, Shutdown):
                    return
                outputs += self._apply(message)
            if self.engine.has_unfinished():
                try:
                    outputs += self.engine.step()
                except Exception as err:  # every open request fails, and is aborted here
                    logger.exception("engine step failed")
                    self.conn.send(StepFailed(portable(err)))
                    outputs += self._abort_all()
            if outputs:
                self.conn.send(StepOutputs([self.encoder.encode(out) for out in outputs]))

    def _abort_all(self) -> list[RequestOutput]:
        """End every open request (a failed step leaves none to retry); their last outputs."""
        ended = [self.engine.abort(request_id) for request_id in sorted(self.engine.seqs)]
        return [out for out in ended if out is not None]

    def _arrived(self, block: bool, timeout: float | None = None) -> list[Inbound]:
        """What the server sent since the last look (if `block`, waiting for something, at most
        `timeout` seconds)."""
        messages = []
        if block:
            try:
                messages.append(self.inbox.get(timeout=timeout))
            except queue.Empty:
                return messages
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                return messages

    def _apply(self, message: Inbound) -> list[RequestOutput]:
        """Apply one message; the outputs it produced (an abort's last output)."""
        if isinstance(message, NewRequest):
            try:
                self.engine.add_request(message.prompt_token_ids, message.params, message.request_id,
                                        message.arrival_time)
            except ValueError as err:
                self.conn.send(Rejected(message.request_id, err))
        elif isinstance(message, Abort):
            out = self.engine.abort(message.request_id)
            return [out] if out is not None else []
        elif isinstance(message, Call):
            self._answer(message)
        return []

    def _answer(self, call: Call) -> None:
        try:
            value = getattr(self.engine, call.name)()
        except Exception as err:
            self.conn.send(Reply(call.call_id, None, portable(err)))
            return
        self.conn.send(Reply(call.call_id, value))
