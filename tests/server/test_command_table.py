"""The engine server answers each command type of the wire through an explicit table: every
type in ipc.messages.Command has a handler, and each handler takes the type it is filed under."""
from __future__ import annotations

import typing

from kvscope.engine.server.engine_server import EngineServer
from kvscope.ipc import messages as m


def test_every_command_type_has_a_handler():
    commands = set(typing.get_args(m.Command))
    assert len(commands) >= 8  # hello ... trace_stop: the union really was read
    assert set(EngineServer.HANDLERS) == commands


def test_each_handler_is_filed_under_the_command_it_takes():
    for command, handler in EngineServer.HANDLERS.items():
        hints = typing.get_type_hints(handler, vars(m) | {"m": m})
        assert hints["cmd"] is command, (command, handler.__name__)
